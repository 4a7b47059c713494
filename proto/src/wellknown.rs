//! Conversions between protobuf well-known types and their Rust counterparts, shared by both
//! services' API edges: `Timestamp` ↔ `SystemTime`, `Struct` ↔ `serde_json::Value`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prost_types::{ListValue, Struct, Timestamp, value::Kind};
use serde_json::Value;

pub fn timestamp(t: SystemTime) -> Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

pub fn system_time(t: &Timestamp) -> Option<SystemTime> {
    let secs = u64::try_from(t.seconds).ok()?;
    let nanos = u32::try_from(t.nanos).ok()?;
    UNIX_EPOCH.checked_add(Duration::new(secs, nanos))
}

/// A caller's `field` as a time the stores can keep: after 1970 and before the year 9999.
pub fn storable_time(field: &str, t: &Timestamp) -> Result<SystemTime, String> {
    const YEAR_9999: i64 = 253_402_300_799;
    if t.seconds < 0 || t.seconds > YEAR_9999 || !(0..1_000_000_000).contains(&t.nanos) {
        return Err(format!(
            "{field} {}s {}ns is not a time between 1970 and 9999",
            t.seconds, t.nanos
        ));
    }
    system_time(t).ok_or_else(|| format!("{field} is out of range"))
}

pub fn struct_to_json(s: &Struct) -> Value {
    Value::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), value_to_json(v)))
            .collect(),
    )
}

/// Where `s` holds a number JSON cannot carry (NaN or an infinity), as a path like
/// `a.b[2]`: [`struct_to_json`] would make it null, so an edge refuses it by name instead.
pub fn non_finite_number(s: &Struct) -> Option<String> {
    fn within(v: &prost_types::Value, path: String) -> Option<String> {
        match &v.kind {
            Some(Kind::NumberValue(n)) if !n.is_finite() => Some(path),
            Some(Kind::ListValue(l)) => l
                .values
                .iter()
                .enumerate()
                .find_map(|(i, v)| within(v, format!("{path}[{i}]"))),
            Some(Kind::StructValue(s)) => fields(s, &path),
            _ => None,
        }
    }
    fn fields(s: &Struct, path: &str) -> Option<String> {
        s.fields.iter().find_map(|(k, v)| {
            within(
                v,
                if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                },
            )
        })
    }
    fields(s, "")
}

fn value_to_json(v: &prost_types::Value) -> Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(*b),
        // Struct numbers are doubles; whole numbers become JSON integers so "integer" schemas
        // accept what a grpcurl user typed as 5.
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 9.0e15 => {
            Value::from(*n as i64)
        }
        Some(Kind::NumberValue(n)) => {
            serde_json::Number::from_f64(*n).map_or(Value::Null, Value::Number)
        }
        Some(Kind::StringValue(s)) => Value::String(s.clone()),
        Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(value_to_json).collect()),
        Some(Kind::StructValue(s)) => struct_to_json(s),
    }
}

pub fn json_to_struct(v: &Value) -> Option<Struct> {
    match v {
        Value::Object(map) => Some(Struct {
            fields: map
                .iter()
                .map(|(k, v)| (k.clone(), json_to_value(v)))
                .collect(),
        }),
        _ => None,
    }
}

fn json_to_value(v: &Value) -> prost_types::Value {
    let kind = match v {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(a) => Kind::ListValue(ListValue {
            values: a.iter().map(json_to_value).collect(),
        }),
        Value::Object(_) => Kind::StructValue(json_to_struct(v).unwrap_or_default()),
    };
    prost_types::Value { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_or_an_infinity_anywhere_in_a_struct_is_found_by_its_path() {
        let number = |n: f64| prost_types::Value {
            kind: Some(Kind::NumberValue(n)),
        };
        let inner = Struct {
            fields: [(
                "scores".to_owned(),
                prost_types::Value {
                    kind: Some(Kind::ListValue(ListValue {
                        values: vec![number(1.0), number(f64::NAN)],
                    })),
                },
            )]
            .into(),
        };
        let outer = Struct {
            fields: [
                ("ok".to_owned(), number(2.5)),
                (
                    "inner".to_owned(),
                    prost_types::Value {
                        kind: Some(Kind::StructValue(inner)),
                    },
                ),
            ]
            .into(),
        };
        assert_eq!(
            non_finite_number(&outer).as_deref(),
            Some("inner.scores[1]")
        );
        let fine = Struct {
            fields: [("x".to_owned(), number(f64::MAX))].into(),
        };
        assert_eq!(non_finite_number(&fine), None);
        let infinite = Struct {
            fields: [("x".to_owned(), number(f64::NEG_INFINITY))].into(),
        };
        assert_eq!(non_finite_number(&infinite).as_deref(), Some("x"));
    }

    #[test]
    fn json_arguments_round_trip_through_struct_with_integers_kept() {
        let v = serde_json::json!({"q": "from:boss", "max_results": 5, "ratio": 0.5, "tags": ["a", null], "nested": {"ok": true}});
        assert_eq!(struct_to_json(&json_to_struct(&v).unwrap()), v);
    }
}
