//! What agent-svc's group commit and group admission share beyond `svc_kit::group`: a
//! connection for a batch, a batch the database refused handed to the one-by-one path, and a
//! batch whose outcome is unknown answered as such.

use svc_kit::pg;

pub(super) use svc_kit::group::{Counters, start};

use crate::store::StoreError;

/// An item waiting to be written by agent-svc's store, and the way in for items of one kind.
pub(super) type Waiting<I, O> = svc_kit::group::Waiting<I, O, StoreError>;
pub(super) type Queue<I, O> = svc_kit::group::Queue<I, O, StoreError>;

/// A connection for a batch, or — the pool has none to give — `None`, every waiter of
/// `waiting` told so.
pub(super) async fn connection<I, O>(
    pool: &pg::PgPool,
    waiting: &mut Vec<Waiting<I, O>>,
) -> Option<pg::Pooled> {
    svc_kit::group::connection(pool, "agent", waiting, |e| StoreError::unavailable(e)).await
}

/// A batch the database refused as a whole (`error`): its items go first among those to be
/// written one by one, which returns the connection for them — `client`, or a fresh one if the
/// failure closed it (`None` when the pool has none: every waiter told so).
pub(super) async fn refused_batch<I, O>(
    pool: &pg::PgPool,
    client: pg::Pooled,
    error: &tokio_postgres::Error,
    counts: &Counters,
    batch: Vec<Waiting<I, O>>,
    alone: &mut Vec<Waiting<I, O>>,
) -> Option<pg::Pooled> {
    tracing::debug!(%error, items = batch.len(), "the database refused a batch; writing each item alone");
    counts.retried();
    alone.splice(0..0, batch);
    usable(pool, client, alone).await
}

/// A batch whose statement got no answer (the connection failed under it): it may have
/// committed, so writing it again could repeat it. Each waiter of `batch` is told its `what`'s
/// outcome is unknown (then `advice`), and the items set apart in `alone`, never sent, get a
/// connection that works — `client`, or a fresh one (`None`: every waiter told so).
pub(super) async fn unknown_outcome<I, O>(
    pool: &pg::PgPool,
    client: pg::Pooled,
    error: &tokio_postgres::Error,
    (what, advice): (&str, &str),
    batch: Vec<Waiting<I, O>>,
    alone: &mut Vec<Waiting<I, O>>,
) -> Option<pg::Pooled> {
    tracing::warn!(%error, items = batch.len(), "a {what} batch's outcome is unknown: its connection failed");
    for q in batch {
        q.answer(Err(StoreError::Unavailable(format!(
            "the {what}'s outcome is unknown: the database connection failed ({error}){advice}"
        ))));
    }
    usable(pool, client, alone).await
}

/// `client` if its connection still works, or a fresh one for the items in `alone` (`None`:
/// the pool has none, every waiter told so).
async fn usable<I, O>(
    pool: &pg::PgPool,
    client: pg::Pooled,
    alone: &mut Vec<Waiting<I, O>>,
) -> Option<pg::Pooled> {
    if !client.is_closed() {
        return Some(client);
    }
    // A dead connection's pool slot is freed before waiting for another.
    drop(client);
    connection(pool, alone).await
}
