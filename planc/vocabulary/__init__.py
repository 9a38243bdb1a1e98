"""The language's vocabulary: the syntax tree, the kinds of values a key may hold, units,
the hints that suggest a value, and what some model keys mean in numbers
(model_options); the models, the checker and the runtime all stand on it."""
