"""Hydra configuration tree (structured configs live beside the code they configure).

The compose API needs this file to treat `conf` as a package.
"""
