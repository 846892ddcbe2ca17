"""The trainer: logs → a better bundle, proved better before it ships.

The only code in the repository that imports torch (install the ``train`` extra). The
server never imports this package; ``tests/test_packaging.py`` checks the fence.
"""
