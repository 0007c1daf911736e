"""The wheel carries libdos.so, built for this platform (make python): it is tagged py3-none-<platform>, not
pure Python. The package's metadata is pyproject.toml's."""
from setuptools import setup

try:
    from wheel.bdist_wheel import bdist_wheel
except ImportError:  # building without wheel: pip says so
    bdist_wheel = None

cmdclass = {}
if bdist_wheel is not None:
    class PlatformWheel(bdist_wheel):
        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False  # libdos.so is native code

        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat  # ctypes: any Python 3, no C ABI of its own

    cmdclass["bdist_wheel"] = PlatformWheel

setup(cmdclass=cmdclass)
