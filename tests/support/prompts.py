"""Short English, code and list prompts the default-model tests compare two paths on (fp32
against the fast defaults, fp32 against int8): one list, so both bars read the same text."""

MIXED_PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Water boils at",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n",
    "My favourite food is",
    "The capital of Germany is",
    "Explain photosynthesis:",
    "1, 2, 3, 4, 5,",
    "Dear Sir or Madam,",
    "The quick brown fox",
]
