//! The null backend's per-bucket time tables (`devices.null_timings`): the
//! file formats, their checks and the lookup, read when the config is
//! validated and by each null worker ([`super::null`] says what they mean).

use crate::model::program::Layout;
use crate::model::Program;
use serde::Deserialize;
use std::path::Path;

/// The longest time a table may give one batch, in µs (as
/// `devices.null_us_per_batch`).
pub const MAX_US: f64 = 1e6;

/// Table files larger than this are refused (they are a few KiB).
const MAX_FILE_BYTES: u64 = 16 << 20;

/// A bucket's shape, as a time table names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// `BATCHxSEQ`.
    Padded { batch: usize, seq: usize },
    /// `TOKENSt`: a packed token budget (its sequence count does not matter).
    Packed { tokens: usize },
}

impl Shape {
    /// Parses `32x128` or `1024t`.
    pub fn parse(s: &str) -> Option<Shape> {
        let positive = |v: &str| v.parse::<usize>().ok().filter(|&n| n > 0);
        if let Some(tokens) = s.strip_suffix('t') {
            return Some(Shape::Packed {
                tokens: positive(tokens)?,
            });
        }
        let (batch, seq) = s.split_once('x')?;
        Some(Shape::Padded {
            batch: positive(batch)?,
            seq: positive(seq)?,
        })
    }

    /// The shape `program` was built for.
    pub fn of(program: &Program) -> Shape {
        match program.layout {
            Layout::Packed { tokens } => Shape::Packed { tokens },
            Layout::Padded => Shape::Padded {
                batch: program.batch,
                seq: program.seq,
            },
        }
    }

    /// Token slots: batch × seq, or the budget.
    fn slots(self) -> f64 {
        match self {
            Shape::Padded { batch, seq } => (batch * seq) as f64,
            Shape::Packed { tokens } => tokens as f64,
        }
    }

    /// Whether a graph of shape `self` would hold a batch of shape `other`
    /// (`None`: they are not of one kind).
    fn holds(self, other: Shape) -> Option<bool> {
        match (self, other) {
            (Shape::Padded { batch, seq }, Shape::Padded { batch: b, seq: s }) => {
                Some(batch >= b && seq >= s)
            }
            (Shape::Packed { tokens }, Shape::Packed { tokens: t }) => Some(tokens >= t),
            _ => None,
        }
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shape::Padded { batch, seq } => write!(f, "{batch}x{seq}"),
            Shape::Packed { tokens } => write!(f, "{tokens}t"),
        }
    }
}

/// One row of a time table.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// `None`: every model.
    pub model: Option<String>,
    pub dtype: Option<String>,
    pub shape: Shape,
    pub us: f64,
}

/// A per-bucket time table (`devices.null_timings`); see the module docs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    pub entries: Vec<Entry>,
}

/// The hand-written form.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SimpleTable {
    buckets: Vec<SimpleEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SimpleEntry {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    dtype: Option<String>,
    bucket: String,
    us: f64,
}

/// What is read of `backend-check --out` (src/tools/backend_check/report.rs);
/// everything else in it is ignored.
#[derive(Deserialize)]
struct CheckReport {
    models: Vec<CheckModel>,
}

#[derive(Deserialize)]
struct CheckModel {
    name: String,
    #[serde(default)]
    dtype: Option<String>,
    #[serde(default)]
    buckets: Vec<CheckBucket>,
}

#[derive(Deserialize)]
struct CheckBucket {
    bucket: String,
    #[serde(default = "yes")]
    served: bool,
    #[serde(default)]
    error: Option<String>,
    latency: CheckLatency,
}

#[derive(Deserialize)]
struct CheckLatency {
    median_us: f64,
}

fn yes() -> bool {
    true
}

impl Timings {
    /// Reads a table file; the error names the file and what is wrong.
    pub fn load(path: &Path) -> Result<Timings, String> {
        let shown = path.display();
        let meta = std::fs::metadata(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
        if !meta.is_file() {
            return Err(format!("cannot read {shown}: not a regular file"));
        }
        if meta.len() > MAX_FILE_BYTES {
            return Err(format!(
                "{shown}: {} bytes, more than a time table's {MAX_FILE_BYTES}",
                meta.len()
            ));
        }
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
        Timings::parse(&text).map_err(|e| format!("{shown}: {e}"))
    }

    /// Parses either form of the module docs.
    pub fn parse(text: &str) -> Result<Timings, String> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let mut entries = Vec::new();
        if value.get("buckets").is_some() {
            let table: SimpleTable = serde_json::from_value(value).map_err(|e| {
                format!("not a time table ({{\"buckets\": [{{\"model\", \"bucket\", \"us\"}}, ...]}}): {e}")
            })?;
            for (i, e) in table.buckets.into_iter().enumerate() {
                let shape = bucket_shape(&e.bucket).map_err(|m| format!("buckets[{i}]: {m}"))?;
                check_us(e.us).map_err(|m| format!("buckets[{i}] ({}): {m}", e.bucket))?;
                entries.push(Entry {
                    model: e.model,
                    dtype: e.dtype,
                    shape,
                    us: e.us,
                });
            }
        } else if value.get("models").is_some() {
            let report: CheckReport = serde_json::from_value(value)
                .map_err(|e| format!("not a `replayd backend-check --out` report: {e}"))?;
            for m in report.models {
                for b in m.buckets {
                    if !b.served || b.error.is_some() || b.latency.median_us <= 0.0 {
                        continue;
                    }
                    let shape =
                        bucket_shape(&b.bucket).map_err(|e| format!("model {}: {e}", m.name))?;
                    check_us(b.latency.median_us)
                        .map_err(|e| format!("model {} bucket {}: {e}", m.name, b.bucket))?;
                    entries.push(Entry {
                        model: Some(m.name.clone()),
                        dtype: m.dtype.clone(),
                        shape,
                        us: b.latency.median_us,
                    });
                }
            }
        } else {
            return Err("expected an object with `buckets` (a time table written by hand) or `models` (what `replayd backend-check --out` writes)".into());
        }
        if entries.is_empty() {
            return Err("no bucket times in it".into());
        }
        Ok(Timings { entries })
    }

    /// The time of one batch in a graph of `shape` for `model` in `dtype`,
    /// in µs; `None` where the table has nothing of that model and kind.
    pub fn lookup(&self, model: &str, dtype: &str, shape: Shape) -> Option<f64> {
        let named: Vec<&Entry> = self
            .entries
            .iter()
            .filter(|e| e.model.as_deref() == Some(model))
            .collect();
        let mine = if named.is_empty() {
            self.entries.iter().filter(|e| e.model.is_none()).collect()
        } else {
            named
        };
        // One dtype: the model's own, else the first listed.
        let wanted = if mine.iter().any(|e| e.dtype.as_deref() == Some(dtype)) {
            Some(dtype)
        } else {
            mine.first().and_then(|e| e.dtype.as_deref())
        };
        let kind: Vec<&Entry> = mine
            .into_iter()
            .filter(|e| e.dtype.is_none() || e.dtype.as_deref() == wanted)
            .filter(|e| e.shape.holds(shape).is_some())
            .collect();
        if let Some(e) = kind.iter().find(|e| e.shape == shape) {
            return Some(e.us);
        }
        // The smallest that holds it (a graph no larger takes no longer).
        let smallest_holding = kind
            .iter()
            .filter(|e| e.shape.holds(shape) == Some(true))
            .min_by(|a, b| {
                (a.shape.slots(), a.us)
                    .partial_cmp(&(b.shape.slots(), b.us))
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
        if let Some(e) = smallest_holding {
            return Some(e.us);
        }
        // None holds it: the nearest in token slots from below (else the
        // smallest), scaled by token slots.
        let by_slots = |a: &&&Entry, b: &&&Entry| a.shape.slots().total_cmp(&b.shape.slots());
        let base = kind
            .iter()
            .filter(|e| e.shape.slots() <= shape.slots())
            .max_by(by_slots)
            .or_else(|| kind.iter().min_by(by_slots))?;
        Some((base.us * shape.slots() / base.shape.slots()).min(MAX_US))
    }
}

fn bucket_shape(bucket: &str) -> Result<Shape, String> {
    Shape::parse(bucket)
        .ok_or_else(|| format!("bucket {bucket:?} is neither BATCHxSEQ (e.g. \"32x128\") nor a packed budget TOKENSt (e.g. \"1024t\")"))
}

fn check_us(us: f64) -> Result<(), String> {
    if us.is_finite() && (0.0..=MAX_US).contains(&us) {
        Ok(())
    } else {
        Err(format!("{us} µs is not between 0 and {MAX_US}"))
    }
}
