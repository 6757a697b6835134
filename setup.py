"""Packaging metadata for opacus-fsdp-sync."""

from setuptools import find_packages, setup

setup(
    name="opacus-fsdp-sync",
    version="0.1.0",
    description=(
        "Opacus ghost clipping under PyTorch FSDP without the first backward's "
        "gradient synchronisation, bit-exact with upstream Opacus."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["opacus_fsdp_sync", "opacus_fsdp_sync.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.13,<2.16", "opacus>=1.6,<1.7", "numpy", "tqdm"],
    extras_require={
        "llama": ["transformers>=4.45"],
        "plot": ["matplotlib"],
        "lora": ["peft>=0.13", "transformers>=4.45"],
        "data": ["datasets"],
        "tensorboard": ["tensorboard"],
        # The fused kernels' tests under Triton's CPU interpreter; CUDA wheels of torch bring
        # their own triton, which the kernels use.
        "kernels-test": ["triton==3.9.0"],
        # the DP trainers (opacus_fsdp_sync.integrations.transformers): checked on these releases
        "hf": ["transformers>=5.24,<6", "accelerate>=1.15"],
        "trl": ["trl>=1.16,<2", "transformers>=5.24,<6", "accelerate>=1.15", "datasets"],
        "dev": [
            "pytest>=7",
            "pytest-timeout",
            "ruff",
            "transformers>=5.24,<6",
            "accelerate>=1.15",
            "trl>=1.16,<2",
            "matplotlib",
            "peft>=0.13",
            "datasets",
        ],
    },
    entry_points={
        "console_scripts": [
            "opacus-fsdp-sync-compare=opacus_fsdp_sync.bench.compare:main",
            "opacus-fsdp-sync-train=opacus_fsdp_sync.train.__main__:main",
        ],
    },
)
