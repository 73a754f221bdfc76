//! Paged K/V bookkeeping for an engine whose sequences share one pool of K/V rows (the GPU
//! engine): pages of one position each ("slots"). A sequence's [`SlotTable`] says which slot holds
//! each of its positions, committed ones first, then the current tree's nodes (the scratch
//! region). Keeping a round's accepted path is then an update of the table, no K/V row moves:
//! the path's slots become committed positions and the rest of the tree's go back to the pool.
//! A sequence holds only the slots it uses, and the pool's size is the engine's whole K/V
//! memory, so the verifier's KV budget counts exactly what is allocated.
//!
//! Host logic only (no device), so that it is tested on every machine.

use crate::{ModelError, Result};

/// The free slots of a pool of `capacity` positions.
#[derive(Debug)]
pub struct SlotPool {
    free: Vec<u32>,
    capacity: usize,
}

impl SlotPool {
    pub fn new(capacity: usize) -> SlotPool {
        assert!(capacity <= u32::MAX as usize, "slot ids are u32");
        // Lowest slots handed out first (popped from the end).
        SlotPool {
            free: (0..capacity as u32).rev().collect(),
            capacity,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// `n` slots, or an error (taking none) when fewer are free.
    fn take(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.free.len() {
            return Err(ModelError::KvPoolFull {
                needed: n,
                free: self.free.len(),
                capacity: self.capacity,
            });
        }
        Ok(self.free.split_off(self.free.len() - n))
    }

    fn give_back(&mut self, slots: impl IntoIterator<Item = u32>) {
        self.free.extend(slots);
        debug_assert!(self.free.len() <= self.capacity);
    }
}

/// Which slots hold one sequence's positions: `slots[p]` holds position p; the first
/// `committed` are final, the rest are the current tree's nodes in tree order.
#[derive(Debug, Default)]
pub struct SlotTable {
    slots: Vec<u32>,
    committed: usize,
}

impl SlotTable {
    pub fn committed(&self) -> usize {
        self.committed
    }

    /// Slots held, committed and scratch.
    pub fn held(&self) -> usize {
        self.slots.len()
    }

    /// The slot of every position held.
    pub fn slots(&self) -> &[u32] {
        &self.slots
    }

    /// Gives the tree's nodes `first..nodes` slots (the first `first` nodes of the scratch
    /// region are kept: scored by an earlier call), returning the scratch region's first
    /// position whose slot changed. On error (pool exhausted) nothing changes.
    pub fn place_tree(&mut self, pool: &mut SlotPool, first: usize, nodes: usize) -> Result<usize> {
        assert!(first <= self.slots.len() - self.committed && first <= nodes);
        let keep = self.committed + first;
        // The scratch slots past `first` are reused room: checked before any is given back.
        let reusable = self.slots.len() - keep;
        if nodes - first > pool.free() + reusable {
            return Err(ModelError::KvPoolFull {
                needed: nodes - first,
                free: pool.free() + reusable,
                capacity: pool.capacity,
            });
        }
        pool.give_back(self.slots.drain(keep..));
        let fresh = pool.take(nodes - first)?;
        self.slots.extend(fresh);
        Ok(keep)
    }

    /// Keeps the scratch nodes of `path` (strictly increasing node indices of the current
    /// tree) as the next committed positions, returns the rest of the tree's slots to the pool,
    /// and returns the first position whose slot changed (the old committed count).
    pub fn keep_path(&mut self, pool: &mut SlotPool, path: &[u32]) -> usize {
        let scratch = self.slots.len() - self.committed;
        assert!(
            path.windows(2).all(|w| w[0] < w[1]),
            "path must be strictly increasing"
        );
        assert!(
            path.last().is_none_or(|&n| (n as usize) < scratch),
            "path leaves the tree"
        );
        let tree = self.slots.split_off(self.committed);
        let mut kept = path.iter().peekable();
        for (node, slot) in tree.into_iter().enumerate() {
            if kept.next_if(|&&n| n as usize == node).is_some() {
                self.slots.push(slot);
            } else {
                pool.give_back([slot]);
            }
        }
        let changed = self.committed;
        self.committed = self.slots.len();
        changed
    }

    /// Keeps the first `len` committed positions (at most the committed count) and returns
    /// every other slot to the pool.
    pub fn rollback(&mut self, pool: &mut SlotPool, len: usize) {
        assert!(len <= self.committed, "cannot roll forward");
        pool.give_back(self.slots.drain(len..));
        self.committed = len;
    }

    /// Returns every slot to the pool.
    pub fn release(&mut self, pool: &mut SlotPool) {
        self.rollback(pool, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeping_a_path_moves_no_row_and_frees_the_rest_of_the_tree() {
        let mut pool = SlotPool::new(16);
        let mut t = SlotTable::default();
        // A 3-token prompt, committed whole.
        assert_eq!(t.place_tree(&mut pool, 0, 3).unwrap(), 0);
        assert_eq!(t.keep_path(&mut pool, &[0, 1, 2]), 0);
        let prompt = t.slots().to_vec();
        // A 6-node tree; nodes 0, 2 and 5 are accepted.
        assert_eq!(t.place_tree(&mut pool, 0, 6).unwrap(), 3);
        let tree = t.slots()[3..].to_vec();
        assert_eq!(pool.free(), 16 - 9);
        assert_eq!(t.keep_path(&mut pool, &[0, 2, 5]), 3);
        assert_eq!(t.committed(), 6);
        // The accepted nodes' slots, in path order: their K/V rows stay where they were written.
        assert_eq!(&t.slots()[..3], &prompt[..]);
        assert_eq!(&t.slots()[3..], &[tree[0], tree[2], tree[5]]);
        assert_eq!(
            pool.free(),
            16 - 6,
            "the three rejected nodes' slots are free again"
        );
        // Every slot is held once or free once.
        let mut all: Vec<u32> = t.slots().iter().chain(&pool.free).copied().collect();
        all.sort();
        assert_eq!(all, (0..16).collect::<Vec<_>>());
    }

    #[test]
    fn a_tree_scored_in_two_calls_keeps_its_first_nodes_slots() {
        let mut pool = SlotPool::new(8);
        let mut t = SlotTable::default();
        t.place_tree(&mut pool, 0, 2).unwrap();
        let early = t.slots().to_vec();
        assert_eq!(t.place_tree(&mut pool, 2, 5).unwrap(), 2);
        assert_eq!(&t.slots()[..2], &early[..]);
        assert_eq!((t.held(), pool.free()), (5, 3));
        // A new tree over the same committed positions replaces the scratch region.
        assert_eq!(t.place_tree(&mut pool, 0, 1).unwrap(), 0);
        assert_eq!((t.held(), pool.free()), (1, 7));
    }

    #[test]
    fn an_exhausted_pool_refuses_the_tree_and_changes_nothing() {
        let mut pool = SlotPool::new(4);
        let mut t = SlotTable::default();
        t.place_tree(&mut pool, 0, 3).unwrap();
        t.keep_path(&mut pool, &[0, 1, 2]);
        let before = t.slots().to_vec();
        match t.place_tree(&mut pool, 0, 2) {
            Err(ModelError::KvPoolFull {
                needed: 2, free: 1, ..
            }) => {}
            other => panic!("expected KvPoolFull, got {other:?}"),
        }
        assert_eq!((t.slots(), pool.free()), (&before[..], 1));
        t.rollback(&mut pool, 1);
        assert_eq!((t.committed(), t.held(), pool.free()), (1, 1, 3));
        t.release(&mut pool);
        assert_eq!(pool.free(), 4);
    }
}
