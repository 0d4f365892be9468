"""The kernel layer's failures."""

from __future__ import annotations


class KernelError(OSError):
    """A kernel interface, or the tool that drives it, refused or failed. `details`: what was
    asked of it (a restore script, a transaction), for the error's reader."""

    def __init__(self, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.msg = msg
        self.details = details

    def __str__(self) -> str:
        return self.msg


class NetnsError(KernelError):
    """A network namespace cannot be opened or entered; `gone` when it does not exist (or is
    no namespace): the container it belonged to is gone."""

    def __init__(self, msg: str, gone: bool = False) -> None:
        super().__init__(msg)
        self.gone = gone


class FirewallError(KernelError):
    """An iptables binary is missing or failed, or nftables did (cni.kernel.nftables.NftError);
    the plugin reports code 103."""


class SysctlError(KernelError):
    """A sysctl cannot be written."""
