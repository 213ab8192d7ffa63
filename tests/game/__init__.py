"""Tests of the game layer (`diprl.game`): fast, offline, pure Python."""
