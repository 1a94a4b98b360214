"""Draft trees and the policies that build them from a drafter's proposal (BlockProposal or TreeProposal)."""

from bastion.tree.draft_tree import DraftTree, pack

__all__ = ["DraftTree", "pack"]
