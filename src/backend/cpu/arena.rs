//! The activation arena: memory shared by every plan of one CPU backend.
//!
//! A worker replays one graph at a time (the backend is `&mut self`), and a
//! plan never reads an activation it has not written in the same run (a rule
//! of the IR, checked by [`crate::model::Program::validate`]), so all plans
//! may lay their activations out from the start of one arena. It grows to
//! the largest plan's needs and never shrinks.

/// Arena offsets are rounded up to this many f32 elements (a 64-byte cache line).
pub(crate) const ARENA_ALIGN: usize = 16;

/// What a plan needs of the [`Arena`], in f32 elements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ArenaNeeds {
    /// Its activation buffers, laid out one after another from offset 0.
    pub activations: usize,
    /// Attention's score scratch: `workers · seq²`.
    pub scratch: usize,
}

impl ArenaNeeds {
    pub(crate) fn bytes(self) -> u64 {
        (self.activations + self.scratch) as u64 * 4
    }
}

/// Activation memory shared by every plan of a backend: one plan runs at a
/// time, and a plan never reads an activation it has not written in the same
/// run (checked at capture), so plans may overwrite each other's.
///
/// It only grows (to the largest need of the plans run in it) and never
/// shrinks.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    pub(crate) activations: Vec<f32>,
    pub(crate) scratch: Vec<f32>,
}

impl Arena {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> u64 {
        (self.activations.len() + self.scratch.len()) as u64 * 4
    }

    /// Whether a plan with these needs can run without growing the arena.
    pub(crate) fn fits(&self, needs: ArenaNeeds) -> bool {
        self.activations.len() >= needs.activations && self.scratch.len() >= needs.scratch
    }

    /// Grows the arena to hold `needs`; returns the bytes it grew by (0 if it
    /// already fits). The contents are not kept (nothing reads them).
    pub(crate) fn ensure(&mut self, needs: ArenaNeeds) -> u64 {
        let before = self.bytes();
        for (v, need) in [
            (&mut self.activations, needs.activations),
            (&mut self.scratch, needs.scratch),
        ] {
            if v.len() < need {
                // Free first: the old contents need not be copied, and the
                // peak stays at the new size.
                *v = Vec::new();
                *v = vec![0.0; need];
            }
        }
        self.bytes() - before
    }
}
