"""Chat prompts the batching tests share: short requests, and a long rule list to build long
prompts (and shared prefixes) from."""

PROMPTS = [[{"role": "user", "content": c}] for c in (
    "Write a Python function that adds two numbers.",
    "Name three colours of the rainbow.",
    "Count from one to ten in words, separated by commas.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List the first five prime numbers.",
    "Explain what a variable is in one sentence.",
    "Say hello in French and in Spanish.",
)]
RULES = "\n".join(f"Rule {i}: when the input mentions item {i}, answer with the code word "
                  f"alpha-{i * 7 % 13} and nothing else." for i in range(40))
