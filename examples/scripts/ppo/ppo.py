"""PPO with a critic: `posttrain ppo` at the path TRL's docs use
(README: "Coming from TRL")."""

if __name__ == "__main__":
    from posttrain.cli import run_as

    run_as(
        "ppo",
        # the dataset TRL's script loads when --dataset_name is not given (descriptiveness prompts)
        dataset_name="trl-internal-testing/descriptiveness-sentiment-trl-style",
        dataset_train_split="descriptiveness",
    )
