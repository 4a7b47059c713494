//! Arguments as tools read them: a number the schema accepts is the number the tool uses.

mod common;

use gateway_svc::{integrations::tasks, store::memory::MemoryStore};
use serde_json::json;

/// G-3: JSON Schema's "integer" accepts `2.0` (and models write it); the tool then acts on
/// task 2, never on "task #0" or a default it falls back to.
#[tokio::test]
async fn g3_an_integer_written_with_a_fraction_of_zero_is_read_as_that_integer() {
    let stores = MemoryStore::stores();
    let engine = common::engine(&stores, tasks::tools(stores.tasks.clone()));
    for title in ["Call dentist", "Pay rent"] {
        let added = common::call(&engine, "a", "add_task", json!({"title": title}), "k").await;
        assert!(added.ok(), "{}", added.text);
    }
    let done = common::call(&engine, "c", "complete_task", json!({"task_id": 2.0}), "k").await;
    assert!(done.ok(), "{}", done.text);
    assert!(done.text.contains("#2"), "{}", done.text);
    let completed = common::call(
        &engine,
        "l",
        "list_tasks",
        json!({"status": "completed"}),
        "k",
    )
    .await;
    assert!(completed.text.contains("Pay rent"), "{}", completed.text);
    assert!(
        !completed.text.contains("Call dentist"),
        "{}",
        completed.text
    );
}
