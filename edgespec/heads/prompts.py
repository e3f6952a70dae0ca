"""Built-in prompts the target answers itself, for training heads when the user gives little text of their own.

The held-out prompts are never trained on: the heads file's accuracy figures
come from the target's greedy replies to them, the kind of text drafting meets.
Both sets mix code, explanation and conversation, as the chat and the server see.
"""

TRAINING_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a bash script that counts the lines of every .py file in a folder.",
    "What is a hash table, and when is a lookup in one slow?",
    "Write a JavaScript function that debounces another function.",
    "Summarise the causes of the French Revolution in a paragraph.",
    "Write a SQL query that finds the ten customers with the highest total order value.",
    "How do I reverse a linked list in C? Show the code.",
    "Give three tips for writing clear commit messages.",
    "Write a Python class for a stack with push, pop and peek.",
    "Explain what a closure is, with an example in JavaScript.",
    "Write a function in Go that reads a file and counts its words.",
    "What does the HTTP status code 429 mean, and how should a client react?",
    "Write a Rust function that checks whether a string is a palindrome.",
    "Explain big-O notation to a beginner.",
    "Write a Python script that downloads a web page and prints its title.",
    "What are the pros and cons of microservices?",
    "Write a regular expression that matches an email address, and explain it.",
    "Write unit tests with pytest for a function that adds two numbers.",
    "Describe how a CPU cache works in simple terms.",
    "Write a TypeScript interface for a user with a name, an email and optional roles.",
    "Convert this loop to a list comprehension: result = []; for x in data: if x > 0: result.append(x * 2)",
    "Write a short story of five sentences about a robot learning to paint.",
    "How does garbage collection work in Java?",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain the CAP theorem.",
    "Write a Dockerfile for a small Flask application.",
    "What is the difference between a process and a thread?",
    "Write a C++ function that computes the greatest common divisor of two integers.",
    "Give an example of a SQL injection and how to prevent it.",
    "Write a Python function that parses a CSV file into a list of dictionaries.",
    "Explain recursion using the factorial function.",
    "Write an HTML page with a form that asks for a name and an email.",
    "What is the difference between git merge and git rebase?",
    "Write a Python decorator that times how long a function takes.",
    "Explain what an API is to someone who does not program.",
    "Write a function that flattens a nested list in Python.",
    "How do I make an HTTP POST request with curl?",
    "Write a binary search in Java.",
    "Write a haiku about debugging at night.",
)

HELDOUT_PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Explain what a mutex is and why it is needed.",
    "Write a JavaScript function that deep-copies an object.",
    "What is the difference between TCP and UDP?",
    "Write a Python function that counts how often each word occurs in a text.",
    "Explain how HTTPS keeps a connection private.",
)
