"""GRPO with reward functions or models: `posttrain grpo` at the path TRL's docs use
(README: "Coming from TRL")."""

if __name__ == "__main__":
    from posttrain.cli import run_as

    run_as("grpo")
