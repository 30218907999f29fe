//! Starting the batcher shards ([`super::shards`]): which graph devices
//! each shard owns, one [`BatcherActor`] per shard, and the [`Batchers`]
//! handle over them. Apart from [`super::shards`] so that the handle, which
//! every device's reporter holds, does not depend on the device routes the
//! actors send through.

use super::queue::{DeviceKind, SchedulerConfig};
use super::shards::{partition, shard_count, Batchers, DeviceLinks, Shard, ShardLoad, SubmitQueue};
use super::{BatcherActor, BatcherArgs, ModelSlot};
use crate::daemon::metrics::Metrics;
use crate::daemon::route::DeviceRoute;
use ractor::Actor;
use std::sync::Arc;
use tokio::task::JoinHandle;

/// What [`start`] needs: [`BatcherArgs`] for the whole daemon.
pub struct ShardedArgs {
    pub models: Vec<ModelSlot>,
    /// Every device slot: its kind and label, in slot order.
    pub devices: Vec<(DeviceKind, String)>,
    /// The way to each device slot, in slot order.
    pub routes: Vec<Arc<DeviceRoute>>,
    pub config: SchedulerConfig,
    pub max_attempts: u32,
    pub metrics: Arc<Metrics>,
    /// `batching.shards` (0: automatic, see [`shard_count`]).
    pub shards: usize,
}

/// Starts the shards. Returns the handle and each actor's join handle.
pub async fn start(args: ShardedArgs) -> anyhow::Result<(Batchers, Vec<JoinHandle<()>>)> {
    anyhow::ensure!(
        args.routes.len() == args.devices.len(),
        "{} device routes for {} devices",
        args.routes.len(),
        args.devices.len()
    );
    let kinds: Vec<DeviceKind> = args.devices.iter().map(|(k, _)| *k).collect();
    let graph = kinds.iter().filter(|k| **k == DeviceKind::Graph).count();
    let count = shard_count(args.shards, graph);
    if args.shards > count {
        tracing::info!(
            wanted = args.shards,
            shards = count,
            "batching.shards is more than the graph devices: one shard per device"
        );
    }
    let plan = partition(&kinds, count);
    let mut devices: Vec<DeviceLinks> = kinds.iter().map(|&k| DeviceLinks::new(k)).collect();
    let mut shards = Vec::with_capacity(count);
    let mut handles = Vec::with_capacity(count);
    for (s, slots) in plan.iter().enumerate() {
        for (local, &slot) in slots.iter().enumerate() {
            devices[slot].links.push((s, local));
        }
        let submissions = Arc::new(SubmitQueue::default());
        let load = Arc::new(ShardLoad::default());
        let (actor, handle) = Actor::spawn(
            None,
            BatcherActor,
            BatcherArgs {
                models: args.models.clone(),
                devices: slots.iter().map(|&d| args.devices[d].clone()).collect(),
                routes: slots.iter().map(|&d| args.routes[d].clone()).collect(),
                config: args.config.clone(),
                max_attempts: args.max_attempts,
                metrics: args.metrics.clone(),
                submissions: submissions.clone(),
                shard: s,
                load: load.clone(),
            },
        )
        .await
        .map_err(|e| anyhow::anyhow!("cannot start batcher shard {s}: {e}"))?;
        shards.push(Shard {
            actor,
            submissions,
            load,
        });
        handles.push(handle);
    }
    tracing::info!(
        shards = count,
        graph_devices = graph,
        "batcher shards (batching.shards)"
    );
    let batchers = Batchers::of(shards, devices);
    Ok((batchers, handles))
}
