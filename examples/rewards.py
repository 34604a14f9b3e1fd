"""Example reward functions for `--task grpo --reward-function examples/rewards.py:NAME` (posttraining/rl.py).

A reward function takes (prompt, completion, record): the prompt's text, the completion's text (its closing
end-of-document token left out), and the record of the prompt's JSON line (every key but "prompt" too), and returns a
float. The default, rl.closes_brackets, checks the shipped prompts' answers (close a line of Python's brackets).

Run:    make train ARGS="--task grpo --reward-function examples/rewards.py:digits --pretrained-checkpoint runs/gpt-sft"
"""


def digits(prompt: str, completion: str, record: dict) -> float:
    """The fraction of the completion's characters that are digits: a dense reward any model gets a spread of."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def brevity(prompt: str, completion: str, record: dict) -> float:
    """Minus the completion's length in characters over 100: a length penalty (shorter answers score higher)."""
    return -len(completion) / 100


def exact(prompt: str, completion: str, record: dict) -> float:
    """1 if the completion, stripped, is the record's "answer" exactly, else 0."""
    return float(completion.strip() == str(record.get("answer", "")).strip())
