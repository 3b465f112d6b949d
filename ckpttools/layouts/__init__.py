"""One plug-in per checkpoint layout ckpttools reads: each detects its folders, reads them into the neutral model
with its own invariant checks, describes them for `inspect`, and, where it can be written, plans native rank
files and universal files. `registry` lists them; docs/adding-a-layout.md is the checklist for a new one."""
