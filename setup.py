from setuptools import find_packages, setup

setup(
    name="rlhfkit",
    version="0.1.0",
    description="A DeepSpeed-based RLHF pipeline: SFT -> reward model -> PPO (and GRPO, DAPO, RLOO, REINFORCE++, DPO)",
    packages=find_packages(include=["rlhfkit", "rlhfkit.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4,<2.15",
        "deepspeed>=0.16",
        "transformers>=4.56",
        "datasets>=3.0",
        "sentencepiece",
        "tensorboard",
        "safetensors",
        "peft>=0.13",
        "accelerate>=1.0",
        "gguf>=0.10",
        "tqdm",
        "pyyaml",
        "numpy",
        "pyarrow",
        "matplotlib",
    ],
    extras_require={"serve": ["fastapi>=0.110", "uvicorn>=0.29", "httpx>=0.27"],
                    "dev": ["pytest>=8", "pexpect", "fastapi>=0.110", "uvicorn>=0.29", "httpx>=0.27"]},
    entry_points={"console_scripts": ["rlhfkit=rlhfkit.cli:main"]},
)
