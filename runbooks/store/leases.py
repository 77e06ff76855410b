"""Leases: named, expiring locks in the database (engine locks, admission,
the service's leader), shared by every process and replica of the store."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, update
from vllm_runbook.runbooks.store.base import StoreBase
from vllm_runbook.runbooks.store.models import Lease, utcnow


class LeaseStore(StoreBase):
    """Take, renew, release and read leases (one row per name)."""

    def acquire_lease(self, name: str, holder: str, ttl_seconds: float) -> bool:
        """Take or extend the named lease; False while another holder's is live.

        Uses this host's clock: replicas are assumed NTP-synchronised to well
        under the TTL.
        """
        now = utcnow()
        expires = now + timedelta(seconds=ttl_seconds)
        with self.session(write=True) as s:
            taken = s.execute(
                update(Lease)
                .where(Lease.name == name, (Lease.holder == holder) | (Lease.expires_at <= now))
                .values(holder=holder, expires_at=expires)
                .execution_options(synchronize_session=False)
            )
            if taken.rowcount == 1:  # type: ignore[attr-defined]
                return True
            inserted = s.execute(
                self._insert()(Lease)
                .values(name=name, holder=holder, expires_at=expires)
                .on_conflict_do_nothing(index_elements=["name"])
                .returning(Lease.name)
            ).scalar_one_or_none()
            return inserted is not None

    def renew_lease(self, name: str, holder: str, ttl_seconds: float) -> bool:
        """Extend a lease this holder still holds; False if it lapsed or was taken."""
        now = utcnow()
        with self.session(write=True) as s:
            renewed = s.execute(
                update(Lease)
                .where(Lease.name == name, Lease.holder == holder, Lease.expires_at > now)
                .values(expires_at=now + timedelta(seconds=ttl_seconds))
                .execution_options(synchronize_session=False)
            )
            return renewed.rowcount == 1  # type: ignore[attr-defined]

    def release_lease(self, name: str, holder: str) -> bool:
        """Give a lease up early so another replica need not wait for the TTL."""
        with self.session(write=True) as s:
            released = s.execute(
                update(Lease)
                .where(Lease.name == name, Lease.holder == holder)
                .values(expires_at=utcnow())
                .execution_options(synchronize_session=False)
            )
            return released.rowcount == 1  # type: ignore[attr-defined]

    def live_holders(self, prefix: str) -> list[str]:
        """The holders of the live leases whose names start with `prefix`, sorted
        (e.g. the rules replicas that split the fleet, one lease each)."""
        with self.session() as s:
            return sorted(
                s.scalars(
                    select(Lease.holder).where(
                        Lease.name.startswith(prefix, autoescape=True),
                        Lease.expires_at > utcnow(),
                    )
                )
            )

    def lease_holder(self, name: str) -> str | None:
        """The current holder of a live lease, or None."""
        with self.session() as s:
            return s.scalar(
                select(Lease.holder).where(Lease.name == name, Lease.expires_at > utcnow())
            )
