"""``python -m ckpttool`` (and ``torchrun -m ckpttool``): the same CLI as the ``ckpttool`` command."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="ckpttool")
