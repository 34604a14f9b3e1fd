"""posttraining — applications on top of the training loop: SFT, DPO, KTO and reward models (recipes.py), LoRA
adapters (lora.py), online RL with GRPO and PPO (rl.py). train.py runs them as tasks (`--task`, `--lora-rank`)."""
