"""The build directory that planc compile writes: writing it, and reading its files back
as untrusted input (the ranks' half needs no graph)."""
