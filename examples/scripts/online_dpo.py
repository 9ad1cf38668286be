"""Online DPO with a judge or a reward model: `posttrain online-dpo` at the path TRL's docs use
(README: "Coming from TRL")."""

if __name__ == "__main__":
    from posttrain.cli import run_as

    run_as("online-dpo")
