"""Contracts shared by every other package: configs, request and sampling types, errors, the device switch.

Nothing here imports another package of this project.
"""
