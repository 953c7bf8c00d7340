"""Repository tools (docs generators, option-claim checks): run from the repository root, e.g.
`python -m tools.gen_docs`. Not part of the rlhfkit package."""
