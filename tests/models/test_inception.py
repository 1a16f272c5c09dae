"""Wide Inception-style CNN: shapes, inputs, four-branch width."""

import pytest
import torch

from batchcraft import models
from batchcraft.parallel import analyze
