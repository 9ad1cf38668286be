"""RLOO on TL;DR summaries: `posttrain rloo` at the path TRL's docs use
(README: "Coming from TRL")."""

if __name__ == "__main__":
    from posttrain.cli import run_as

    run_as("rloo", dataset="tldr")  # TRL's script loads this dataset when none is given
