"""The win rate of TL;DR summaries judged by an LLM: `posttrain judge` at the path TRL's docs use
(README: "Coming from TRL")."""

if __name__ == "__main__":
    from posttrain.cli import run_as

    run_as("judge")
