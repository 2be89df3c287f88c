"""One-off experiments: each settled one design choice, and its docstring says which and where its result is kept."""
