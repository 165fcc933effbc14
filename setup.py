"""Eyrie: train EAGLE-3 drafters for large targets and hand SGLang a drafter it can serve."""
from setuptools import find_packages, setup

# torch is pinned exactly on purpose: on the CPU machines `torch==2.13.0` resolves to a CPU wheel on
# local disk, while any range admitting newer releases downloads multi-GB CUDA builds.
# GPU machines bring their own torch; install there with `pip install --no-deps -e .`.
CORE = [
    "torch==2.13.0",
    "transformers>=5.8.1,<6",
    "tokenizers>=0.22",
    "datasets>=4.0,<6",
    "safetensors>=0.4",
    "pyarrow>=17",
    "pydantic>=2.6,<3",
    "pyyaml>=6",
    "deepspeed>=0.16,<0.20",
    "tensorboard>=2.15",
    "tqdm>=4.66",
    "jinja2>=3.1",
    "requests>=2.31",
    "xxhash>=3",
    "matplotlib>=3.8",
]

setup(
    name="eyrie",
    version="0.1.0",
    description=__doc__,
    # 3.11: PYTHONSAFEPATH (the commands the pipeline starts never import from the working directory)
    python_requires=">=3.11",
    packages=find_packages(include=["data", "extract", "train", "train.*", "serve", "launch"]),
    package_data={"launch": ["configs/*.yaml"]},
    install_requires=CORE,
    entry_points={"console_scripts": ["eyrie = launch.cli:main"]},
    extras_require={
        # 0.5.14 serves on the GPU machine (torch 2.11); 0.5.23 is the CPU loader check's version.
        "sglang": ["sglang>=0.5.14,<=0.5.23"],
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.6", "hypothesis>=6.100", "psutil"],
    },
)
