"""Tandem's tooling: the `tandem` command (`demo`, `bench`, `trace`) and trace timelines.

It sits beside the core library (`engine`, `scheduler`), which never imports it.
Importing this package loads nothing else: each command imports what it needs
when it runs, so `tandem --help` stays instant.
"""
