//! The supervisor actor: starts one device actor per device (and per eager
//! worker), and starts a replacement when one fails.
//!
//! ractor's default supervision stops the supervisor when a child dies; here
//! a failed device actor is replaced instead (its `post_stop` has already
//! killed its worker), the batcher is told the device went down so the
//! batches it held are re-dispatched, and the new actor takes the slot's
//! route to the batcher over as it starts. Worker *processes* are restarted by their device
//! actor; this layer only guards against bugs in the actors themselves.

use super::batcher::shards::Batchers;
use super::device::{DeviceActor, DeviceArgs};
use super::messages::DeviceMsg;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use std::time::Duration;

/// Messages to the supervisor.
pub enum SupervisorMsg {
    /// The device actors, by device slot.
    Devices(RpcReplyPort<Vec<ActorRef<DeviceMsg>>>),
    /// Stop every worker (daemon shutdown); answers when all have exited.
    StopAll(RpcReplyPort<()>),
    /// Kill these devices' workers (NVML reported their GPU unhealthy); they restart.
    Kill { slots: Vec<usize>, reason: String },
}

pub struct SupervisorArgs {
    pub devices: Vec<DeviceArgs>,
    pub batchers: Batchers,
}

pub struct SupervisorState {
    args: Vec<DeviceArgs>,
    children: Vec<ActorRef<DeviceMsg>>,
    batchers: Batchers,
    stopping: bool,
    replacements: u64,
}

pub struct Supervisor;

impl Supervisor {
    /// Starts a device actor, which takes over its slot's
    /// [`super::route::DeviceRoute`] as it starts.
    async fn start_child(
        myself: &ActorRef<SupervisorMsg>,
        args: DeviceArgs,
    ) -> Result<ActorRef<DeviceMsg>, ActorProcessingErr> {
        let (child, _) = Actor::spawn_linked(None, DeviceActor, args, myself.get_cell()).await?;
        Ok(child)
    }

    fn slot_of(state: &SupervisorState, cell: &ActorCell) -> Option<usize> {
        state
            .children
            .iter()
            .position(|c| c.get_id() == cell.get_id())
    }
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        args: SupervisorArgs,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let mut children = Vec::new();
        for device in &args.devices {
            children.push(Self::start_child(&myself, device.clone()).await?);
        }
        Ok(SupervisorState {
            args: args.devices,
            children,
            batchers: args.batchers,
            stopping: false,
            replacements: 0,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::Devices(port) => {
                let _ = port.send(state.children.clone());
            }
            SupervisorMsg::Kill { slots, reason } => {
                for slot in slots {
                    if let Some(child) = state.children.get(slot) {
                        let _ = child.cast(DeviceMsg::Kill {
                            reason: reason.clone(),
                        });
                    }
                }
            }
            SupervisorMsg::StopAll(port) => {
                state.stopping = true;
                let children = state.children.clone();
                // Wait off the handler so the supervisor stays responsive.
                tokio::spawn(async move {
                    let waits = children
                        .iter()
                        .map(|c| c.call(DeviceMsg::Stop, Some(Duration::from_secs(60))));
                    futures::future::join_all(waits).await;
                    let _ = port.send(());
                });
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        event: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, why) = match &event {
            SupervisionEvent::ActorFailed(cell, err) => (cell.clone(), format!("failed: {err}")),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell.clone(), format!("terminated: {reason:?}"))
            }
            _ => return Ok(()),
        };
        let Some(slot) = Self::slot_of(state, &cell) else {
            return Ok(());
        };
        if state.stopping {
            return Ok(());
        }
        let args = state.args[slot].clone();
        tracing::error!(device = %args.label, "device actor {why}; replacing it");
        state
            .batchers
            .device_down(args.device, &format!("device actor {why}"));
        state.replacements += 1;
        state.children[slot] = Self::start_child(&myself, args).await?;
        Ok(())
    }
}
