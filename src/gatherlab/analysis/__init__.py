"""Reading what runs wrote: run and sweep files into pandas, every run against its 1-device
reference and the tables, and the figures in one style.

Modules:

- ``results``: run and sweep files loaded into pandas, the only reader of run files above training
- ``report``: a sweep's runs against their 1-device references, the loss matrix, the audit's tables
- ``figures``: the library's figures, and the one style of every figure (colours, the reference)
"""
