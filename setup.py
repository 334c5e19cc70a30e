"""Builds ashl and its native module ashl._C through CMake."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = ROOT / "build" / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        bin_dir = Path(sys.executable).parent
        cmake = shutil.which("cmake", path=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        if cmake is None:
            raise RuntimeError("cmake not found: pip install cmake (make bootstrap does)")
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DASHL_WITH_CUDA={os.environ.get('ASHL_WITH_CUDA', 'auto')}",
            f"-DASHL_NATIVE={os.environ.get('ASHL_NATIVE', 'ON')}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        ninja = shutil.which("ninja", path=str(bin_dir)) or shutil.which("ninja")
        if ninja and not (build_dir / "CMakeCache.txt").exists():
            args += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        subprocess.check_call([cmake, str(ROOT), *args], cwd=build_dir)
        subprocess.check_call([cmake, "--build", ".", "-j", str(os.cpu_count() or 2)], cwd=build_dir)


setup(
    packages=find_packages("src"),
    package_dir={"": "src"},
    # the emulated hosts' remote shell (ashl.netns; executable, copied executable if need be)
    package_data={"ashl": ["hostexec"]},
    ext_modules=[CMakeExtension("ashl._C")],
    cmdclass={"build_ext": CMakeBuild},
)
