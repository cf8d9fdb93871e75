"""Python code generated from protos/pagoda/v1/*.proto by `make protos` (scripts/gen_protos.py).

Do not edit the *_pb2*.py / *.pyi files by hand: change the .proto files and regenerate;
`make test` fails when these files are stale. Only this __init__.py is written by hand.
"""
