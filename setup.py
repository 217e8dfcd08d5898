"""Builds the C++ engine (csrc/) as a plain shared library that engine/ loads with ctypes."""
import glob
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildEngine(build_ext):
    """build_ext that fails with one clear line when no C++ compiler is available."""

    def build_extensions(self):
        compiler = self.compiler.compiler_cxx[0] if getattr(self.compiler, "compiler_cxx", None) else "c++"
        if shutil.which(compiler) is None:
            sys.exit(f"powerinfer-tools: no C++17 compiler found ('{compiler}'); install g++ or clang++ and retry")
        super().build_extensions()

    def get_export_symbols(self, ext):
        return []  # a ctypes library, not a Python module: no PyInit_ symbol


# every .cpp under csrc/ but the fuzz target (scripts/fuzz_engine.sh builds it)
sources = sorted(p for p in glob.glob("csrc/**/*.cpp", recursive=True) if not p.startswith("csrc/fuzz/"))
engine = Extension(
    "engine._pi_engine",
    sources=sources,
    include_dirs=["csrc", "csrc/include"],
    # headers and the shared x86 kernel bodies: a change to any of them rebuilds the library
    depends=sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.inc", recursive=True)),
    language="c++",
    extra_compile_args=["-std=c++17", "-O3", "-fPIC", "-pthread"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[engine] if sources else [], cmdclass={"build_ext": BuildEngine})
