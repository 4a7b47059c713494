//! Grouped reads (issue 13, Q-2): the reads every run makes through the gateway — the user's
//! accounts (its tool list), the memory lookup of its prompt, its task list — wait for a few
//! reader tasks, and a reader sends whatever waits when it comes free as one statement over
//! all those users, then answers each with its own rows. A burst of runs started together is
//! where PostgreSQL's fixed cost per statement (and the gateway's per checkout and round trip)
//! was a share of the first wave's latency; a lone read goes out at once, alone.
//!
//! Each statement takes its inputs as arrays numbered `WITH ORDINALITY` and returns that
//! number last on every row, so rows go back to the read that asked for them. A batch the
//! database refuses as a whole is read again one by one, so one read's bad input never fails
//! the others; reads change nothing, so reading again is always safe.

use std::{
    future::Future,
    sync::{Arc, LazyLock},
};

use svc_kit::{
    group::{self, Counters, Queue, Waiting},
    pg,
};
use tokio_postgres::{Row, types::ToSql};

use super::{
    ACCOUNT_COLUMNS, TASK_COLUMNS, TASK_ORDER, account_from_row, note_from_row, task_from_row,
};
use crate::{
    domain::UserId,
    store::{Note, StoreError, StoredAccount, Task, TaskFilter, words},
};

/// The most reads one statement carries: enough to amortise the statement, few enough that a
/// batch read again one by one stays short.
const MAX_BATCH: usize = 32;

/// One kind of grouped read: its statement over a batch, and each row's owner.
trait Read: Send + Sync + Sized + 'static {
    /// What one row decodes to; a read's answer is its rows', in the statement's order.
    type Item: Send + 'static;
    const WHAT: &'static str;
    /// The `kind` label of its batch metrics.
    const KIND: &'static str;

    /// The batch's rows, each ending with the (1-based) number of the read it answers.
    fn rows<'a>(
        client: &'a pg::Pooled,
        batch: &'a [&'a Self],
    ) -> impl Future<Output = Result<Vec<Row>, tokio_postgres::Error>> + Send + 'a;

    /// One row of a read's answer.
    fn decode(row: &Row) -> Result<Self::Item, StoreError>;
}

pub(super) struct Reads {
    accounts: Queue<Accounts, Vec<StoredAccount>, StoreError>,
    notes: Queue<NoteSearch, Vec<Note>, StoreError>,
    tasks: Queue<TaskList, Vec<Task>, StoreError>,
    /// Per kind, labelled so in the metrics: accounts, memory searches, task lists.
    counts: [Arc<Counters>; 3],
}

impl Reads {
    /// Starts `workers` reader tasks per kind of read on `pool`; they end when this is dropped.
    pub(super) fn start(pool: &pg::PgPool, workers: usize) -> Self {
        let counts = [Accounts::KIND, NoteSearch::KIND, TaskList::KIND].map(|kind| {
            let counts = Counters::new(
                "steward_db_read_batch_size",
                "steward_db_read_batches_retried_total",
            );
            Arc::new(counts.of_kind(kind))
        });
        Self {
            accounts: queue(pool, workers, &counts[0]),
            notes: queue(pool, workers, &counts[1]),
            tasks: queue(pool, workers, &counts[2]),
            counts,
        }
    }

    /// Every kind's counts together.
    pub(super) fn counts(&self) -> svc_kit::group::BatchCounts {
        self.counts
            .iter()
            .map(|c| c.read())
            .fold(Default::default(), |all, c| svc_kit::group::BatchCounts {
                statements: all.statements + c.statements,
                written: all.written + c.written,
                batches_retried: all.batches_retried + c.batches_retried,
            })
    }

    pub(super) async fn accounts(&self, user: &UserId) -> Result<Vec<StoredAccount>, StoreError> {
        self.accounts.submit(Accounts { user: user.clone() }).await
    }

    pub(super) async fn notes(
        &self,
        user: &UserId,
        query: &str,
        limit: usize,
    ) -> Result<Vec<Note>, StoreError> {
        // Every word as a prefix, for the second pass (see `SQL_NOTES`).
        let terms: Vec<String> = words(query).into_iter().map(|w| format!("{w}:*")).collect();
        self.notes
            .submit(NoteSearch {
                user: user.clone(),
                query: query.to_owned(),
                limit: limit as i64,
                terms: terms.join(" | "),
            })
            .await
    }

    pub(super) async fn tasks(
        &self,
        user: &UserId,
        filter: TaskFilter,
    ) -> Result<Vec<Task>, StoreError> {
        self.tasks
            .submit(TaskList {
                user: user.clone(),
                filter,
            })
            .await
    }
}

fn queue<R: Read>(
    pool: &pg::PgPool,
    workers: usize,
    counts: &Arc<Counters>,
) -> Queue<R, Vec<R::Item>, StoreError> {
    let (pool, counts) = (pool.clone(), counts.clone());
    group::start(workers, MAX_BATCH, R::WHAT, move |batch| {
        let (pool, counts) = (pool.clone(), counts.clone());
        async move { read(&pool, batch, &counts).await }
    })
}

/// Reads a batch as one statement, or — the database refused it (one read's input) — each
/// read alone on the same connection.
async fn read<R: Read>(
    pool: &pg::PgPool,
    mut batch: Vec<Waiting<R, Vec<R::Item>, StoreError>>,
    counts: &Counters,
) {
    // A read whose caller gave up (a deadline passed) costs the database nothing.
    batch.retain(|w| !w.is_abandoned());
    if batch.is_empty() {
        return;
    }
    let Some(client) =
        group::connection(pool, "gateway", &mut batch, |e| StoreError::unavailable(e)).await
    else {
        return;
    };
    let outcome = {
        let items: Vec<&R> = batch.iter().map(|w| &w.item).collect();
        R::rows(&client, &items).await
    };
    counts.wrote(batch.len());
    match outcome {
        Ok(rows) => answer_each(batch, &rows),
        Err(e) if batch.len() > 1 && e.as_db_error().is_some() && !client.is_closed() => {
            tracing::debug!(error = %e, reads = batch.len(), what = R::WHAT, "the database refused a batch of reads; reading each alone");
            counts.retried();
            for w in batch {
                let outcome = R::rows(&client, &[&w.item]).await;
                counts.wrote(1);
                match outcome {
                    Ok(rows) => answer_each(vec![w], &rows),
                    Err(e) => w.answer(Err(StoreError::db(e))),
                }
            }
        }
        // A read alone that failed, or a connection that broke under the batch: each is told
        // what happened (reading again is the caller's call, as it was for a single read).
        Err(e) => answer_all(batch, &StoreError::db(e)),
    }
}

fn answer_all<R: Read>(batch: Vec<Waiting<R, Vec<R::Item>, StoreError>>, error: &StoreError) {
    for w in batch {
        w.answer(Err(error.clone()));
    }
}

/// Gives each read of `batch` the rows numbered for it (rows come ordered by that number).
fn answer_each<R: Read>(batch: Vec<Waiting<R, Vec<R::Item>, StoreError>>, rows: &[Row]) {
    let mut rows = rows.iter().peekable();
    for (n, w) in (1_i64..).zip(batch) {
        let mut mine = Vec::new();
        while let Some(row) = rows.next_if(|r| r.get::<_, i64>(r.len() - 1) == n) {
            mine.push(R::decode(row));
        }
        w.answer(mine.into_iter().collect());
    }
}

/// The text arrays of a batch, one per column, as statement parameters.
fn column<R>(batch: &[&R], value: impl Fn(&R) -> String) -> Vec<String> {
    batch.iter().map(|r| value(r)).collect()
}

struct Accounts {
    user: UserId,
}

/// Every account of each user, as `list_accounts` orders them.
static SQL_ACCOUNTS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {ACCOUNT_COLUMNS}, u.o FROM unnest($1::text[]) WITH ORDINALITY AS u(uid, o) \
         JOIN gateway.accounts a ON a.user_id = u.uid ORDER BY u.o, integration, account"
    )
});

impl Read for Accounts {
    type Item = StoredAccount;
    const WHAT: &'static str = "account read";
    const KIND: &'static str = "accounts";

    async fn rows(client: &pg::Pooled, batch: &[&Self]) -> Result<Vec<Row>, tokio_postgres::Error> {
        let users = column(batch, |r| r.user.as_str().to_owned());
        client.query(&*SQL_ACCOUNTS, &[&users]).await
    }

    fn decode(row: &Row) -> Result<Self::Item, StoreError> {
        account_from_row(row)
    }
}

struct TaskList {
    user: UserId,
    filter: TaskFilter,
}

/// Each user's tasks that pass its filter, as `list_tasks` orders them.
static SQL_TASKS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {TASK_COLUMNS}, u.o FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(uid, filter, o) \
         JOIN gateway.tasks t ON t.user_id = u.uid AND (u.filter = 'all' \
           OR (u.filter = 'pending' AND t.completed_at IS NULL) \
           OR (u.filter = 'completed' AND t.completed_at IS NOT NULL)) \
         ORDER BY u.o, {TASK_ORDER}"
    )
});

impl Read for TaskList {
    type Item = Task;
    const WHAT: &'static str = "task read";
    const KIND: &'static str = "tasks";

    async fn rows(client: &pg::Pooled, batch: &[&Self]) -> Result<Vec<Row>, tokio_postgres::Error> {
        let users = column(batch, |r| r.user.as_str().to_owned());
        let filters = column(batch, |r| {
            match r.filter {
                TaskFilter::All => "all",
                TaskFilter::Pending => "pending",
                TaskFilter::Completed => "completed",
            }
            .to_owned()
        });
        client.query(&*SQL_TASKS, &[&users, &filters]).await
    }

    fn decode(row: &Row) -> Result<Self::Item, StoreError> {
        task_from_row(row)
    }
}

struct NoteSearch {
    user: UserId,
    query: String,
    limit: i64,
    /// Every word of the query as a prefix, joined by `|` (empty: no words).
    terms: String,
}

/// Each user's notes that match its query: full-text search with every word (stemmed, ranked by
/// cover density) first; only when that finds nothing, any word as a prefix, so "meet" or a
/// half-typed name still finds something. Most runs' [ABOUT THE USER] lookups find nothing the
/// first way, so the second pass reads the user's notes' stored 'simple' vectors (migration V9)
/// rather than parsing each note again.
const SQL_NOTES: &str = "SELECT f.id, f.content, f.tags, f.created_at, f.origin, u.o \
    FROM unnest($1::text[], $2::text[], $3::int8[], $4::text[]) WITH ORDINALITY AS u(uid, query, lim, terms, o) \
    CROSS JOIN LATERAL ( \
      WITH exact AS ( \
        SELECT id, content, tags, created_at, origin, ts_rank_cd(tsv, q) AS rank \
        FROM gateway.memories, websearch_to_tsquery('english', u.query) q \
        WHERE user_id = u.uid AND tsv @@ q ORDER BY rank DESC, id DESC LIMIT u.lim), \
      loose AS ( \
        SELECT id, content, tags, created_at, origin, \
               ts_rank_cd(tsv_simple, q) AS rank \
        FROM gateway.memories, to_tsquery('simple', u.terms) q \
        WHERE u.terms <> '' AND NOT EXISTS (SELECT 1 FROM exact) AND user_id = u.uid \
          AND tsv_simple @@ q \
        ORDER BY rank DESC, id DESC LIMIT u.lim) \
      SELECT *, 0 AS pass FROM exact UNION ALL SELECT *, 1 AS pass FROM loose) f \
    ORDER BY u.o, f.pass, f.rank DESC, f.id DESC";

impl Read for NoteSearch {
    type Item = Note;
    const WHAT: &'static str = "memory search";
    const KIND: &'static str = "memory_search";

    async fn rows(client: &pg::Pooled, batch: &[&Self]) -> Result<Vec<Row>, tokio_postgres::Error> {
        let users = column(batch, |r| r.user.as_str().to_owned());
        let queries = column(batch, |r| r.query.clone());
        let terms = column(batch, |r| r.terms.clone());
        let limits: Vec<i64> = batch.iter().map(|r| r.limit).collect();
        let params: [&(dyn ToSql + Sync); 4] = [&users, &queries, &limits, &terms];
        client.query(SQL_NOTES, &params).await
    }

    fn decode(row: &Row) -> Result<Self::Item, StoreError> {
        note_from_row(row)
    }
}
