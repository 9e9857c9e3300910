"""Tools around the trainer: benchmark and its peers, memory estimate, checkpoint format converter.

They live at the repository root, apart from the core, and install as titanlite.tools
(`python -m titanlite.tools.<name>`) through the link titanlite/tools. Run them, and launch
them under torchrun, as modules: `tokenize.py` would shadow the standard library's tokenize
for a script run from this folder.
"""
