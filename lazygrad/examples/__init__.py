"""Small models of the shapes lazygrad is for: the demo's, the tests' and the benchmarks'."""
