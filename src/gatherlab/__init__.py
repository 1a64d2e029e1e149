"""gatherlab: does a distributed contrastive loss train exactly like one big batch on one device?"""
