from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

version = {}
for line in Path("megatron_perf_toggles/_version.py").read_text().splitlines():
    if line.startswith("__version__"):
        exec(line, version)


class BuildWithPatches(build_py):
    """Ship the top-level patches/ inside the package (megatron_perf_toggles/data/patches), and the
    measured per-process GPU overhead that ablate --concurrent reads (data/process_overhead.json)."""

    def run(self):
        super().run()
        data = Path(self.build_lib) / "megatron_perf_toggles" / "data"
        target = data / "patches"
        for src in sorted(Path("patches").glob("*/*.patch")):
            dest = target / src.parent.name / src.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(src.read_bytes())
        overhead = Path("docs") / "benchmarks" / "process_overhead.json"
        if overhead.is_file():
            data.mkdir(parents=True, exist_ok=True)
            (data / overhead.name).write_bytes(overhead.read_bytes())


setup(
    name="megatron-perf-toggles",
    version=version["__version__"],
    description="Default-on performance toggles for Megatron-LM, with guards, precision-tagged "
    "log directories and provenance",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["megatron_perf_toggles", "megatron_perf_toggles.*"]),
    package_data={"megatron_perf_toggles": ["data/*.json", "data/surfaces/*.json", "data/bridge_recipes/*.json"]},
    cmdclass={"build_py": BuildWithPatches},
    python_requires=">=3.10",
    install_requires=[],
    extras_require={
        # loguru: Primus's logger, for the tests that run a job through Primus's own code path.
        # setuptools: the tests build the package's wheel without network (a Python 3.12 venv has none).
        "test": ["pytest>=7", "ruff>=0.4", "mypy>=1.10,<2.5", "loguru", "setuptools>=61"],
        # What Megatron-LM's parse_args + validate_args + TransformerConfig import on a CPU-only
        # machine, core 0.13 to main (pydantic from 0.16), next to torch. torch is not listed: a
        # plain "torch" from PyPI is a multi-GB CUDA build; install PyTorch's CPU build first (README).
        "megatron-cpu": ["numpy", "packaging", "six", "regex", "pyyaml", "pydantic"],
        "plot": ["matplotlib"],
        # Planning a Megatron-Bridge recipe needs nothing beyond the package: its recorded catalog
        # (package data) serves where Bridge is not installed (Bridge itself does not install on a
        # CPU machine). Primus's loader logs through loguru and reads YAML.
        "bridge": [],
        "primus": ["loguru", "pyyaml"],
    },
    entry_points={"console_scripts": ["megatron-perf-toggles=megatron_perf_toggles.tools.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
