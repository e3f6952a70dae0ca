"""Built-in prompts the target answers itself, for training heads when the user gives little text of their own.

The target's own replies are the text heads must learn to guess, and the
default training is limited by how many reply tokens it can collect, not by
prompts: a run answers a few hundred of them.  So the training set is made
of programming tasks in several languages, questions to explain, code to
change and prose to write, interleaved so that any first part of it mixes
all four, as the chat and the server see.

The held-out prompts are never trained on (nor are their tasks): the heads
file's accuracy figures come from the target's greedy replies to them.
"""

from __future__ import annotations

from itertools import chain, zip_longest

HELDOUT_PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Explain what a mutex is and why it is needed.",
    "Write a JavaScript function that deep-copies an object.",
    "What is the difference between TCP and UDP?",
    "Write a Python function that counts how often each word occurs in a text.",
    "Explain how HTTPS keeps a connection private.",
)

_LANGUAGES = ("Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "C#", "Ruby", "Kotlin", "bash")

_TASKS = (
    "returns the n-th Fibonacci number iteratively",
    "reverses a string without using a built-in reverse",
    "merges two sorted arrays into one sorted array",
    "finds the largest element of a list and its index",
    "checks whether a string is a palindrome, ignoring case and spaces",
    "removes duplicate values from a list while keeping their order",
    "computes the greatest common divisor of two integers",
    "parses a line of comma-separated values into fields, honouring quotes",
    "converts a temperature from Celsius to Fahrenheit and back",
    "implements binary search on a sorted array",
    "reads a text file and prints its lines in reverse order",
    "validates that a password has at least 8 characters, a digit and an upper-case letter",
    "flattens a nested list of integers",
    "groups a list of people by their age",
    "returns the k most frequent elements of an array",
    "implements a stack with push, pop and peek",
    "implements a queue using two stacks",
    "rotates a matrix by 90 degrees clockwise",
    "converts a Roman numeral to an integer",
    "formats a number of bytes as a human-readable size such as 1.5 MB",
    "retries a failing operation up to three times with a growing delay",
    "sorts a list of records by two keys",
    "computes the moving average of a series of numbers",
    "checks whether two strings are anagrams",
    "splits a list into chunks of a given size",
    "implements a simple LRU cache",
    "returns every permutation of a short string",
    "transposes a matrix",
    "counts the vowels in a sentence",
    "finds the first character of a string that does not repeat",
)

_TOPICS = (
    "a hash table", "recursion", "a closure", "garbage collection", "big-O notation", "a race condition",
    "a deadlock", "the difference between a process and a thread", "dependency injection", "a REST API",
    "a database index", "SQL joins", "database transactions and ACID", "the CAP theorem", "eventual consistency",
    "a load balancer", "caching and cache invalidation", "DNS", "how a CPU cache works", "virtual memory",
    "what a compiler does", "the difference between compiled and interpreted languages", "static and dynamic typing",
    "functional programming", "immutability", "object-oriented inheritance", "composition over inheritance",
    "the SOLID principles", "unit tests and integration tests", "test-driven development", "continuous integration",
    "containers and Docker", "Kubernetes pods", "git branches", "the difference between git merge and git rebase",
    "semantic versioning", "OAuth", "JSON Web Tokens", "cross-site scripting", "SQL injection",
    "public-key cryptography", "hash functions", "async and await", "an event loop", "threads and a thread pool",
    "memoization", "dynamic programming", "a linked list", "a binary search tree", "a heap and a priority queue",
    "graph traversal with breadth-first search", "Dijkstra's algorithm", "regular expressions", "Unicode and UTF-8",
    "floating-point rounding errors", "a memory leak", "pointers in C", "Rust's borrow checker", "Python generators",
    "Python decorators", "JavaScript promises", "WebSockets", "HTTP caching headers", "the HTTP status codes 4xx and 5xx",
    "rate limiting", "message queues", "microservices and a monolith", "logging levels", "code review",
)

_EXPLAIN = (
    "Explain {topic}.",
    "Explain {topic} to a beginner, with an example.",
    "What is {topic}, and when does it matter in practice?",
)

_SNIPPETS = (
    "def average(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)",
    "function sum(arr) {\n  var s = 0;\n  for (var i = 0; i <= arr.length; i++) s += arr[i];\n  return s;\n}",
    "def read_config(path):\n    f = open(path)\n    data = f.read()\n    return dict(line.split('=') for line in data.splitlines())",
    "for i in range(len(names)):\n    print(str(i) + ': ' + names[i])",
    "SELECT * FROM orders WHERE customer_id IN (SELECT id FROM customers WHERE country = 'FR')",
    "int max(int a[], int n) {\n    int m = 0;\n    for (int i = 0; i < n; i++) if (a[i] > m) m = a[i];\n    return m;\n}",
    "def fetch(url):\n    import requests\n    r = requests.get(url)\n    return r.json()",
    "class User:\n    def __init__(self, name, email):\n        self.name = name\n        self.email = email",
    "if (user != null) {\n  if (user.isActive()) {\n    if (user.hasRole(\"admin\")) {\n      grant();\n    }\n  }\n}",
    "items = []\nfor line in open('data.txt'):\n    if line.strip() != '':\n        items.append(line.strip().lower())",
)

_CHANGES = (
    "Find the bug in this code and fix it:\n\n{code}",
    "Refactor this code to be clearer and more idiomatic:\n\n{code}",
    "Add error handling and comments to this code:\n\n{code}",
    "Explain what this code does, line by line:\n\n{code}",
    "Write unit tests for this code:\n\n{code}",
)

_PROSE = (
    "Write a short story of five sentences about a robot learning to paint.",
    "Write a haiku about debugging at night.",
    "Summarise the causes of the French Revolution in a paragraph.",
    "Give three tips for writing clear commit messages.",
    "Write a polite email asking a colleague to review a pull request.",
    "Write a product description for a mechanical keyboard.",
    "Give five ideas for a weekend programming project.",
    "Write a short README introduction for a command-line tool that renames photos by date.",
    "Describe a good morning routine for a software developer.",
    "Write a limerick about a cat who learns to code.",
    "Explain to a child why the sky is blue.",
    "Write release notes for a version that fixes two bugs and adds dark mode.",
    "Give advice to someone preparing for a technical interview.",
    "Write a short dialogue between a junior and a senior developer about naming variables.",
    "Compare reading documentation with watching video tutorials.",
    "Summarise the plot of Romeo and Juliet in four sentences.",
    "Write a motivational message for a team after a failed release.",
    "List the pros and cons of working remotely.",
    "Write a recipe for a simple tomato pasta.",
    "Describe how to plan a small software project from idea to release.",
)


def _programming() -> list[str]:
    """Every task in every language, the languages rotating so that consecutive prompts differ."""
    return [f"Write a {_LANGUAGES[(t + i) % len(_LANGUAGES)]} function that {task}."
            for i in range(len(_LANGUAGES)) for t, task in enumerate(_TASKS)]


def _interleaved(*groups: list[str]) -> tuple[str, ...]:
    return tuple(p for p in chain.from_iterable(zip_longest(*groups)) if p is not None)


TRAINING_PROMPTS = _interleaved(
    _programming(),
    [template.format(topic=topic) for i, template in enumerate(_EXPLAIN) for topic in _TOPICS[i::len(_EXPLAIN)]]
    + [_EXPLAIN[(i + 1) % len(_EXPLAIN)].format(topic=t) for i, t in enumerate(_TOPICS)],
    [change.format(code=code) for i, code in enumerate(_SNIPPETS) for change in _CHANGES[i % 2::2]]
    + [change.format(code=code) for i, code in enumerate(_SNIPPETS) for change in _CHANGES[(i + 1) % 2::2]],
    list(_PROSE),
)
