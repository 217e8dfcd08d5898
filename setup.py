"""Builds the C++ engine (csrc/) as a plain shared library that engine/ loads with ctypes, and its device libraries
(csrc/device/, pi_device.h): the host emulation the tests use in place of a GPU, and the CUDA library where nvcc is
found (PI_CUDA=1 requires it, PI_CUDA=0 skips it; PI_CUDA_ARCHS lists the GPU architectures to build for). The
engine itself never links a device runtime: it loads a device library at run time, where a run asks for one."""
import glob
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# Turing to Hopper (consumer cards from the RTX 20 series; A100, H100/H200), plus Hopper's PTX for later GPUs
DEFAULT_CUDA_ARCHS = "75;80;86;89;90"
# Each library exports its C API and nothing else: hidden visibility, a version script, and the C++ runtime linked
# in with its symbols kept local, so that no libstdc++ the process loaded (older, newer, conda's) is mixed with the
# one the library was compiled against (docs/engine.md, "Linking: what the libraries export").
ENGINE_EXPORTS = "csrc/capi/exports.map"
DEVICE_EXPORTS = "csrc/capi/device_exports.map"
STATIC_RUNTIME = ["-static-libstdc++", "-static-libgcc", "-Wl,--exclude-libs,ALL"]


class CudaExtension(Extension):
    """A shared library built by nvcc from .cu sources (with static cudart: it loads where no driver is)."""


def _links_static_runtime(cxx: list[str]) -> bool:
    """Whether `cxx` can link libstdc++ into a shared library: Debian's and Ubuntu's g++ can; Fedora's needs the
    libstdc++-static package."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write("#include <stdexcept>\n#include <string>\nvoid probe(const char *s) { throw std::runtime_error(s); }\n")
        cmd = [*cxx, "-shared", "-fPIC", *STATIC_RUNTIME, src, "-o", os.path.join(tmp, "probe.so")]
        return subprocess.call(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0


def _nvcc() -> str | None:
    wanted = os.environ.get("PI_CUDA", "")
    if wanted == "0":
        return None
    nvcc = shutil.which("nvcc")
    if nvcc is None and wanted == "1":
        sys.exit("powerinfer-tools: PI_CUDA=1 but nvcc is not on the PATH")
    return nvcc


class BuildEngine(build_ext):
    """build_ext that fails with one clear line when no C++ compiler is available, and runs nvcc for the CUDA
    library."""

    def build_extensions(self):
        cxx = list(getattr(self.compiler, "compiler_cxx", None) or ["c++"])
        if shutil.which(cxx[0]) is None:
            sys.exit(f"powerinfer-tools: no C++17 compiler found ('{cxx[0]}'); install g++ or clang++ and retry")
        self.static_runtime = _links_static_runtime(cxx)
        if not self.static_runtime:
            print(f"powerinfer-tools: {cxx[0]} cannot link libstdc++ statically (no libstdc++.a); the libraries will "
                  "use the libstdc++ of the process that loads them")
            for ext in self.extensions:
                ext.extra_link_args = [a for a in ext.extra_link_args if a not in STATIC_RUNTIME]
        super().build_extensions()

    def build_extension(self, ext):
        if not isinstance(ext, CudaExtension):
            return super().build_extension(ext)
        out = self.get_ext_fullpath(ext.name)
        newest_input = max(os.path.getmtime(p) for p in ext.sources + ext.depends)
        if os.path.exists(out) and os.path.getmtime(out) >= newest_input and not self.force:
            return
        archs = [a for a in os.environ.get("PI_CUDA_ARCHS", DEFAULT_CUDA_ARCHS).split(";") if a]
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        # nvcc hands -Xcompiler's options to the host compiler's link too
        host = ["-fPIC", *visibility] + (["-static-libstdc++", "-static-libgcc"] if self.static_runtime else [])
        cmd = [_nvcc(), "-O3", "-std=c++17", "-shared", "-Xcompiler", ",".join(host), "-cudart", "static",
               "-Xlinker", f"--exclude-libs,ALL,--version-script={DEVICE_EXPORTS}",
               *[f"-I{d}" for d in ext.include_dirs], *gencode, *ext.sources, "-o", out + ".tmp"]
        print(" ".join(cmd))
        if subprocess.call(cmd) != 0:
            sys.exit("powerinfer-tools: nvcc failed building the CUDA library (PI_CUDA=0 builds without it)")
        os.replace(out + ".tmp", out)

    def get_export_symbols(self, ext):
        return []  # a ctypes library, not a Python module: no PyInit_ symbol


include_dirs = ["csrc", "csrc/include"]
# headers, the shared x86 kernel bodies and the export lists: a change to any of them rebuilds the libraries
headers = sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.inc", recursive=True) +
                 [ENGINE_EXPORTS, DEVICE_EXPORTS])
visibility = ["-fvisibility=hidden", "-fvisibility-inlines-hidden"]
compile_args = ["-std=c++17", "-O3", "-fPIC", "-pthread", *visibility]
# every .cpp under csrc/ but the fuzz target (scripts/fuzz_engine.sh builds it) and the device libraries
sources = sorted(p for p in glob.glob("csrc/**/*.cpp", recursive=True)
                 if not p.startswith(("csrc/fuzz/", "csrc/device/")))
extensions = []
if sources:
    extensions = [
        Extension("powerinfer_engine._pi_engine", sources=sources, include_dirs=include_dirs, depends=headers, language="c++",
                  extra_compile_args=compile_args,
                  extra_link_args=["-pthread", "-ldl", f"-Wl,--version-script={ENGINE_EXPORTS}", *STATIC_RUNTIME]),
        Extension("powerinfer_engine._pi_device_emulated", sources=["csrc/device/emulated_tier.cpp"], include_dirs=include_dirs,
                  depends=headers, language="c++", extra_compile_args=compile_args,
                  extra_link_args=["-pthread", f"-Wl,--version-script={DEVICE_EXPORTS}", *STATIC_RUNTIME]),
    ]
    if _nvcc():
        extensions.append(CudaExtension("powerinfer_engine._pi_cuda", sources=sorted(glob.glob("csrc/device/*.cu")),
                                        include_dirs=include_dirs, depends=headers))

# engine/ is the package powerinfer_engine (its libraries built into it); also installed under its name until 0.1.0,
# `engine`, whose __init__ hands over to powerinfer_engine with a deprecation warning
setup(packages=find_packages(include=["powerinfer_tools", "powerinfer_tools.*"]) + ["powerinfer_engine", "engine"],
      package_dir={"powerinfer_engine": "engine", "engine": "engine"},
      ext_modules=extensions, cmdclass={"build_ext": BuildEngine})
