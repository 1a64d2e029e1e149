"""The words, errors and file formats every layer shares: the vocabularies and tolerances
(`terms`), a command line's one-line error (`cli`), the run files' names and formats
(`runfiles`)."""
