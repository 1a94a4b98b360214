"""Draft trees and the policies that build them from a drafter's proposal (BlockProposal or TreeProposal)."""
