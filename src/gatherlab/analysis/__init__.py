"""Reading what runs wrote: run and sweep files into pandas (`results`), every run against its
1-device reference and the tables (`report`), and the figures in one style (`figures`)."""
