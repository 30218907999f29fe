//! The text `replayctl` prints: the stats, devices, health, bucket grids
//! and reload answers as tables (comfy-table, aligned however long a model's
//! name is). Pure: typed stats in, text out.

use super::{BucketsReport, DeviceStats, Health, ReloadReport, Stats};
use crate::bucket::GridSpec;
use comfy_table::{presets, CellAlignment, ContentArrangement, Table};

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// 1234567 → "1,234,567".
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A latency: "-" for none, else µs, ms or s.
pub fn micros(us: u64) -> String {
    match us {
        0 => "-".into(),
        u if u < 1_000 => format!("{u} µs"),
        u if u < 1_000_000 => format!("{:.2} ms", u as f64 / 1e3),
        u => format!("{:.2} s", u as f64 / 1e6),
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn or_dash(v: Option<impl ToString>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

/// A table with a header, numeric columns (from `right_from` on) right-aligned.
fn table(header: &[&str], right_from: usize) -> Table {
    let mut t = Table::new();
    t.load_preset(presets::ASCII_MARKDOWN)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header.to_vec());
    for i in right_from..header.len() {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

fn list<T: ToString>(v: &[T]) -> String {
    v.iter().map(T::to_string).collect::<Vec<_>>().join(", ")
}

/// A grid in words: `batch buckets [1, 8]`, `token budgets [64], at most 16 sequences`.
pub fn grid_text(g: &GridSpec) -> String {
    match g {
        GridSpec::Packed {
            token_budgets,
            max_seqs_per_batch,
        } => format!(
            "token budgets [{}], at most {max_seqs_per_batch} sequences",
            list(token_budgets)
        ),
        GridSpec::Padded {
            batch_buckets,
            seq_buckets,
        } if seq_buckets == &[1] => format!("batch buckets [{}]", list(batch_buckets)),
        GridSpec::Padded {
            batch_buckets,
            seq_buckets,
        } => format!(
            "batch buckets [{}] × seq buckets [{}]",
            list(batch_buckets),
            list(seq_buckets)
        ),
    }
}

/// `replayctl health`.
pub fn health(h: &Health) -> String {
    let mut out = format!("status: {}\n", h.status.as_str());
    let mut t = table(&["device", "role", "state", "restarts", "last error"], 3);
    for d in &h.devices {
        t.add_row(vec![
            d.device.clone(),
            d.role.as_str().to_string(),
            d.state.as_str().to_string(),
            d.restarts.to_string(),
            d.last_error.clone().unwrap_or_default(),
        ]);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    out
}

/// `replayctl stats`; `prev` (an earlier snapshot and the seconds since)
/// adds rates over that interval (`--watch`).
pub fn stats(s: &Stats, prev: Option<(&Stats, f64)>) -> String {
    let mut out = String::new();
    let (req, lat) = (&s.requests, &s.latency);
    out.push_str(&format!(
        "uptime {:.0} s   requests accepted {}, ok {}, split over batches {}   reloads {}\n",
        s.uptime_s,
        thousands(req.accepted),
        thousands(req.ok),
        thousands(req.split),
        s.reloads,
    ));
    out.push_str(&format!(
        "latency p50/p99: total {} / {}   queued {} / {}   on the device {} / {}\n\n",
        micros(lat.total.p50_us),
        micros(lat.total.p99_us),
        micros(lat.queued.p50_us),
        micros(lat.queued.p99_us),
        micros(lat.compute.p50_us),
        micros(lat.compute.p99_us),
    ));
    let rate = |now: u64, then: u64| -> Option<String> {
        let (_, dt) = prev?;
        Some(format!(
            "{:.1}",
            now.saturating_sub(then) as f64 / dt.max(1e-3)
        ))
    };
    out.push_str(&models_table(s, prev, &rate));
    out.push_str(&buckets_table(s, prev, &rate));

    // Eager work and errors.
    let eager = &s.eager;
    let reasons: Vec<String> = eager
        .by_reason
        .iter()
        .map(|(k, v)| format!("{} {}", k.as_str(), thousands(*v)))
        .collect();
    out.push_str(&format!(
        "eager requests: {}{}   batches {}, sequences {}, tokens {}   queued {}\n",
        thousands(eager.requests),
        if reasons.is_empty() {
            String::new()
        } else {
            format!(" ({})", reasons.join(", "))
        },
        thousands(eager.batches),
        thousands(eager.sequences),
        thousands(eager.tokens),
        s.queue_depth.eager,
    ));
    let errors: Vec<String> = req
        .errors
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| format!("{} {}", k.as_str(), thousands(*n)))
        .collect();
    out.push_str(&format!(
        "errors by code: {}   retried batches {}\n\n",
        if errors.is_empty() {
            "none".into()
        } else {
            errors.join(", ")
        },
        s.retried_batches,
    ));

    // Devices, short.
    let mut t = table(
        &[
            "device",
            "role",
            "state",
            "batches",
            "in flight",
            "graphs",
            "restarts",
        ],
        3,
    );
    for d in &s.devices {
        t.add_row(vec![
            d.label.clone(),
            d.role.as_str().to_string(),
            d.state.as_str().to_string(),
            thousands(d.batches),
            d.inflight.to_string(),
            d.graphs.len().to_string(),
            d.restarts.to_string(),
        ]);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    out
}

type Rate<'a> = dyn Fn(u64, u64) -> Option<String> + 'a;

/// A stats table keyed by its first two columns; `--watch` adds the rate columns.
fn watch_table(columns: &[&str], rates: &[&str], watching: bool) -> Table {
    let mut header = columns.to_vec();
    if watching {
        header.extend(rates);
    }
    table(&header, 2)
}

/// One row per model, then each model's grid.
fn models_table(s: &Stats, prev: Option<(&Stats, f64)>, rate: &Rate) -> String {
    let mut t = watch_table(
        &[
            "model",
            "batching",
            "requests",
            "graph hit rate",
            "eager",
            "errors",
            "tokens",
            "computed",
            "padding",
            "queued",
        ],
        &["req/s"],
        prev.is_some(),
    );
    for m in &s.models {
        let errors: u64 = m.requests.errors.values().sum();
        let mut row = vec![
            m.name.clone(),
            m.batching.clone(),
            thousands(m.requests.ok),
            pct(m.graph_hit_rate),
            thousands(m.requests.eager),
            thousands(errors),
            thousands(m.padding.tokens),
            thousands(m.padding.computed_tokens),
            pct(m.padding.padding_waste),
            s.queue_depth
                .by_model
                .get(&m.name)
                .copied()
                .unwrap_or(0)
                .to_string(),
        ];
        if let Some((p, _)) = prev {
            let then = p.models.iter().find(|x| x.name == m.name);
            row.push(rate(m.requests.ok, then.map_or(0, |x| x.requests.ok)).unwrap_or_default());
        }
        t.add_row(row);
    }
    let mut out = t.to_string();
    out.push('\n');
    for m in &s.models {
        out.push_str(&format!("  {}: {}\n", m.name, grid_text(&m.grid)));
    }
    out.push('\n');
    out
}

/// One row per (model, bucket) that ran anything.
fn buckets_table(s: &Stats, prev: Option<(&Stats, f64)>, rate: &Rate) -> String {
    let mut t = watch_table(
        &[
            "model",
            "bucket",
            "requests",
            "batches",
            "seqs/batch",
            "seq fill",
            "tokens",
            "computed",
            "token fill",
            "padding",
            "p50",
            "p99",
        ],
        &["batch/s", "padding now"],
        prev.is_some(),
    );
    for b in &s.buckets {
        let mut row = vec![
            b.model.clone(),
            format!("{}{}", b.bucket, if b.in_grid { "" } else { " (old)" }),
            thousands(b.requests),
            thousands(b.batches),
            format!("{:.1}", b.seqs_per_batch),
            pct(b.seq_fill),
            thousands(b.tokens),
            thousands(b.computed_tokens),
            pct(b.token_fill),
            pct(b.padding_waste),
            micros(b.p50_us),
            micros(b.p99_us),
        ];
        if let Some((p, _)) = prev {
            let then = p
                .buckets
                .iter()
                .find(|x| x.model == b.model && x.bucket == b.bucket);
            row.push(rate(b.batches, then.map_or(0, |x| x.batches)).unwrap_or_default());
            let (pad0, comp0) = then.map_or((0, 0), |x| (x.padded_tokens, x.computed_tokens));
            let dpad = b.padded_tokens.saturating_sub(pad0);
            let dcomp = b.computed_tokens.saturating_sub(comp0);
            row.push(if dcomp == 0 {
                "-".into()
            } else {
                pct(dpad as f64 / dcomp as f64)
            });
        }
        t.add_row(row);
    }
    let mut out = t.to_string();
    out.push('\n');
    out.push_str(
        "(seq fill: real sequences over the bucket's rows; token fill: real tokens over computed; \
padding: 1 − token fill; p50/p99: latency of the requests named after the bucket)\n\n",
    );
    out
}

/// `replayctl devices`.
pub fn devices(devices: &[DeviceStats]) -> String {
    let mut t = table(
        &[
            "device",
            "role",
            "state",
            "name",
            "pid",
            "graphs",
            "graph memory",
            "shard",
            "queued",
            "batches",
            "in flight",
            "busy",
            "restarts",
            "faults",
            "hangs",
            "GPU memory",
            "GPU util",
            "GPU temp",
        ],
        4,
    );
    let mut errors = Vec::new();
    let mut models = Vec::new();
    for d in devices {
        let memory: u64 = d.graphs.iter().map(|g| g.memory_bytes).sum();
        let (gmem, util, temp) = match d.gpu.as_ref().and_then(|g| g.sample()) {
            Some(g) => (
                format!(
                    "{} / {}",
                    mib(g.memory_used_bytes),
                    mib(g.memory_total_bytes)
                ),
                or_dash(g.utilization_pct.map(|p| format!("{p}%"))),
                or_dash(g.temperature_c.map(|c| format!("{c} °C"))),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        let mut state = d.state.as_str().to_string();
        if let Some((done, total)) = d.capture {
            state = format!("{state} {done}/{total}");
        }
        if d.drained && !state.starts_with("draining") {
            state.push_str(" (drained)");
        }
        t.add_row(vec![
            d.label.clone(),
            d.role.as_str().to_string(),
            state,
            d.name.clone(),
            or_dash(d.worker_pid),
            d.graphs.len().to_string(),
            mib(memory),
            d.shard.map_or_else(|| "all".to_string(), |s| s.to_string()),
            thousands(d.queued),
            thousands(d.batches),
            if d.inflight_tokens > 0 {
                format!("{} ({} t)", d.inflight, thousands(d.inflight_tokens))
            } else {
                d.inflight.to_string()
            },
            format!("{:.1} s", d.busy_us as f64 / 1e6),
            d.restarts.to_string(),
            d.device_faults.to_string(),
            d.hangs.to_string(),
            gmem,
            util,
            temp,
        ]);
        if let Some(e) = &d.last_error {
            errors.push(format!("  {}: {e}", d.label));
        }
        for m in &d.models {
            models.push(format!(
                "  {} {}: weights {}, activations {}, graph buffers {}{}",
                d.label,
                m.model,
                mib(m.weights_bytes),
                mib(m.arena_bytes),
                mib(m.graph_bytes),
                if m.dropped.is_empty() {
                    String::new()
                } else {
                    format!("; no graph (memory): {}", m.dropped.join("; "))
                }
            ));
        }
    }
    let mut out = t.to_string();
    out.push('\n');
    if !models.is_empty() {
        out.push_str("memory per model:\n");
        out.push_str(&models.join("\n"));
        out.push('\n');
    }
    if !errors.is_empty() {
        out.push_str("last errors:\n");
        out.push_str(&errors.join("\n"));
        out.push('\n');
    }
    out
}

/// A text bar chart of (upper bound, count) bins.
fn bars(bins: &[(u64, u64)], unit: &str) -> String {
    let max = bins.iter().map(|b| b.1).max().unwrap_or(0).max(1);
    let mut out = String::new();
    let mut lower = 0;
    for &(hi, n) in bins {
        let width = (40 * n).div_ceil(max) as usize;
        out.push_str(&format!(
            "    {:>13} {unit} {:>9} {}\n",
            if lower + 1 >= hi {
                hi.to_string()
            } else {
                format!("{}–{hi}", lower + 1)
            },
            thousands(n),
            "#".repeat(width)
        ));
        lower = hi;
    }
    out
}

/// `replayctl buckets`.
pub fn buckets(b: &BucketsReport) -> String {
    let mut out = String::new();
    for m in &b.models {
        out.push_str(&format!(
            "model {} ({}): {}\n",
            m.name,
            m.batching,
            grid_text(&m.grid)
        ));
        let mut t = table(
            &[
                "bucket", "devices", "capture", "memory", "requests", "batches", "padding",
            ],
            1,
        );
        let (mut capture, mut memory) = (0, 0);
        for g in &m.graphs {
            capture += g.capture_us;
            memory += g.memory_bytes;
            t.add_row(vec![
                g.bucket.clone(),
                g.devices.to_string(),
                micros(g.capture_us),
                mib(g.memory_bytes),
                thousands(g.requests),
                thousands(g.batches),
                pct(g.padding_waste),
            ]);
        }
        out.push_str(&t.to_string());
        out.push('\n');
        out.push_str(&format!(
            "  {} graphs per device: capture {} in all, {} of static buffers\n",
            m.graphs.len(),
            micros(capture),
            mib(memory)
        ));
        let packed = matches!(m.grid, GridSpec::Packed { .. });
        let rows_only =
            matches!(&m.grid, GridSpec::Padded { seq_buckets, .. } if seq_buckets == &[1]);
        let (hist, what, unit) = if packed {
            (&m.batch_tokens, "tokens per batch", "tok")
        } else if rows_only {
            (&m.batch_rows, "rows per batch", "rows")
        } else {
            (&m.lengths, "tokens per text", "tok")
        };
        let summary = |h: &super::HistogramSummary| {
            format!(
                "n {}, mean {:.1}, p50 {}, p90 {}, p99 {}, max {}",
                thousands(h.count),
                h.mean,
                or_dash(h.p50),
                or_dash(h.p90),
                or_dash(h.p99),
                or_dash(h.max)
            )
        };
        if !rows_only {
            out.push_str(&format!("  texts: {}\n", summary(&m.lengths)));
        }
        if hist.count == 0 {
            out.push_str("  observed: nothing yet (send traffic, then look again)\n\n");
            continue;
        }
        out.push_str(&format!("  observed {what}: {}\n", summary(hist)));
        out.push_str(&bars(&hist.bins, unit));
        for sg in &m.suggestions {
            let key = sg.key.as_str();
            let (cur, new) = (&sg.current_cost, &sg.suggested_cost);
            let unit = if key == "batch_buckets" {
                "rows"
            } else {
                "tokens"
            };
            if sg.current == sg.suggested {
                out.push_str(&format!(
                    "  {key} = [{}]: already the least padding for {} sizes on what was observed ({} {unit} padding)\n",
                    list(&sg.current),
                    sg.current.len(),
                    pct(cur.waste)
                ));
            } else {
                out.push_str(&format!(
                    "  suggested {key} = [{}]\n    instead of [{}]: {unit} padding {} → {} on what was observed (same {} sizes; {} above the largest stay as they are)\n",
                    list(&sg.suggested),
                    list(&sg.current),
                    pct(cur.waste),
                    pct(new.waste),
                    sg.current.len(),
                    thousands(cur.above),
                ));
            }
        }
        if let Some(cap) = &m.seq_cap {
            out.push_str(&format!(
                "  max_seqs_per_batch = {}: {} of batches stopped at it{}\n",
                cap.current,
                pct(cap.share_at_cap),
                if cap.suggested != cap.current {
                    format!(
                        "; suggested {}, so that a full budget of short texts fits",
                        cap.suggested
                    )
                } else {
                    "; keep it".into()
                }
            ));
        }
        out.push('\n');
    }
    out.push_str("Apply a grid by editing the config file, then `replayctl reload` (no restart, no request lost).\n");
    out
}

/// `replayctl reload`.
pub fn reload(r: &ReloadReport) -> String {
    if r.changed.is_empty() {
        return "reload: nothing changed\n".into();
    }
    let mut out = format!("reload applied: {}\n", r.changed.join(", "));
    for m in &r.models {
        out.push_str(&format!(
            "  {}: now {} ({})\n",
            m.model,
            grid_text(&m.grid),
            m.batching
        ));
    }
    if r.graphs_captured > 0 {
        out.push_str(&format!(
            "  {} new graphs captured beside the old ones; the old ones are released\n",
            r.graphs_captured
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::stats::tests::known;

    #[test]
    fn the_stats_table_is_aligned_for_long_model_names() {
        let text = stats(&known(), None);
        let expected = r#"uptime 12 s   requests accepted 5, ok 0, split over batches 0   reloads 0
latency p50/p99: total - / -   queued - / -   on the device - / -

| model                                                            | batching | requests | graph hit rate | eager | errors | tokens | computed | padding | queued |
|------------------------------------------------------------------|----------|----------|----------------|-------|--------|--------|----------|---------|--------|
| sentence-transformers-all-MiniLM-L6-v2-finetuned-support-tickets | packed   |        2 |          50.0% |     1 |      0 |     60 |       64 |    6.2% |      0 |
| mlp                                                              | padded   |        3 |         100.0% |     0 |      1 |     15 |       24 |   37.5% |      0 |
  sentence-transformers-all-MiniLM-L6-v2-finetuned-support-tickets: token budgets [64, 256], at most 16 sequences
  mlp: batch buckets [1, 8]

| model                                                            | bucket | requests | batches | seqs/batch | seq fill | tokens | computed | token fill | padding |     p50 |     p99 |
|------------------------------------------------------------------|--------|----------|---------|------------|----------|--------|----------|------------|---------|---------|---------|
| mlp                                                              | 8x1    |        3 |       3 |        5.0 |    62.5% |     15 |       24 |      62.5% |   37.5% |  250 µs |  250 µs |
| sentence-transformers-all-MiniLM-L6-v2-finetuned-support-tickets | 64t    |        1 |       1 |        2.0 |    12.5% |     60 |       64 |      93.8% |    6.2% | 1.50 ms | 1.50 ms |
(seq fill: real sequences over the bucket's rows; token fill: real tokens over computed; padding: 1 − token fill; p50/p99: latency of the requests named after the bucket)

eager requests: 1 (seq_too_long 1)   batches 1, sequences 1, tokens 300   queued 0
errors by code: overloaded 1   retried batches 0

| device | role | state | batches | in flight | graphs | restarts |
|--------|------|-------|---------|-----------|--------|----------|
"#;
        assert_eq!(text, expected, "got:\n{text}");
        // Every line of a table has the same width as its header.
        for block in text.split("\n\n") {
            let rows: Vec<&str> = block.lines().filter(|l| l.starts_with('|')).collect();
            if let Some(first) = rows.first() {
                for r in &rows {
                    assert_eq!(r.chars().count(), first.chars().count(), "{r}");
                }
            }
        }
    }

    #[test]
    fn watch_adds_rates_over_the_interval() {
        let before = known();
        let mut after = before.clone();
        let b = &mut after.buckets[0];
        assert_eq!(b.bucket, "8x1");
        b.batches = 13;
        b.padded_tokens = 9 + 30;
        b.computed_tokens = 24 + 80;
        let text = stats(&after, Some((&before, 2.0)));
        let row = text.lines().find(|l| l.contains(" 8x1 ")).unwrap();
        assert!(row.contains("|     5.0 |"), "{row}");
        assert!(row.contains("37.5%"), "{row}");
    }

    #[test]
    fn numbers_read_well() {
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(thousands(12), "12");
        assert_eq!(micros(999), "999 µs");
        assert_eq!(micros(1500), "1.50 ms");
        assert_eq!(micros(2_500_000), "2.50 s");
    }
}
