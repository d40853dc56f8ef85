"""Build lpsim's compiled kernels (lpsim._C) ahead of time.

    pip install --no-build-isolation -e .

CPU kernels are always built. The CUDA kernels are built whenever nvcc is found, also on a machine
without a GPU (TORCH_CUDA_ARCH_LIST defaults to "8.0;9.0"); set LPSIM_CUDA=0 to skip them.
"""

import glob
import os
import shutil

from setuptools import setup


def _find_cuda_home():
    """The CUDA toolkit root, set before torch's cpp_extension reads it (it guesses wrongly when
    nvcc on PATH is a wrapper script outside the toolkit)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    for root in ("/usr/local/cuda",):
        if os.path.exists(os.path.join(root, "bin", "nvcc")):
            return root
    nvcc = shutil.which("nvcc")
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None


def _want_cuda(cuda_home):
    if os.environ.get("LPSIM_CUDA", "1") == "0" or cuda_home is None:
        return False
    return os.path.exists(os.path.join(cuda_home, "bin", "nvcc"))


CUDA_HOME = _find_cuda_home()
WITH_CUDA = _want_cuda(CUDA_HOME)
if WITH_CUDA:
    os.environ["CUDA_HOME"] = CUDA_HOME
    import torch  # noqa: E402

    if not torch.cuda.is_available():
        # No GPU to build for: the A100 and H100 generations. With GPUs, torch builds for the
        # architectures of those it sees.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CXX_FLAGS = [
    "-O3",
    "-std=c++20",
    "-fopenmp",
    "-ffp-contract=off",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
]
NVCC_FLAGS = ["-O3", "-std=c++20", "--expt-relaxed-constexpr"]

sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
include_dirs = [os.path.join(HERE, "csrc", "include"), os.path.join(HERE, "csrc")]
define_macros = []
if WITH_CUDA:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    define_macros.append(("LPSIM_WITH_CUDA", None))
    Extension = CUDAExtension
    extra = {"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS}
else:
    Extension = CppExtension
    extra = {"cxx": CXX_FLAGS}

setup(
    ext_modules=[
        Extension(
            name="lpsim._C",
            sources=sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args=extra,
            extra_link_args=["-fopenmp"],
            py_limited_api=False,
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
