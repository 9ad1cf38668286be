"""RLOO on TL;DR summaries: `posttrain rloo` at the path TRL's docs use
(README: "Coming from TRL")."""

if __name__ == "__main__":
    from posttrain.cli import run_as

    run_as(
        "rloo",
        # the dataset TRL's script loads when --dataset_name is not given (TL;DR prompts)
        dataset_name="trl-internal-testing/tldr-preference-sft-trl-style",
        dataset_test_split="validation",
    )
