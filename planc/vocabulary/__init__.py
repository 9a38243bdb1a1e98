"""The language's vocabulary: the syntax tree, the kinds of values a key may hold, units,
and the hints that suggest a value; the models and the checker both stand on it."""
