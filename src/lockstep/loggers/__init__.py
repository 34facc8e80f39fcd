"""Where metrics go, with Composer's names: pass destinations as ``Trainer(loggers=[...])``.

Metric names: ``loss/train/total`` (every batch), ``metrics/eval/<Name>``, ``lr-<Optimizer>/group<i>``
(:class:`~lockstep.callbacks.LRMonitor`), ``throughput/...`` (:class:`~lockstep.callbacks.SpeedMonitor`),
``time/batch``, ``time/epoch``. Every destination logs on rank 0 only unless ``rank_zero_only=False``
(``InMemoryLogger`` and ``FileLogger``: on every rank, as in Composer).
"""

from lockstep.loggers.console import ConsoleLogger
from lockstep.loggers.file_logger import FileLogger
from lockstep.loggers.logger import Logger
from lockstep.loggers.logger_destination import LoggerDestination
from lockstep.loggers.in_memory import InMemoryLogger
from lockstep.loggers.mlflow import MLFlowLogger
from lockstep.loggers.progress_bar_logger import ProgressBarLogger
from lockstep.loggers.remote_uploader_downloader import RemoteUploaderDownloader
from lockstep.loggers.tensorboard import TensorboardLogger
from lockstep.loggers.wandb import WandBLogger

__all__ = ["ConsoleLogger", "FileLogger", "InMemoryLogger", "Logger", "LoggerDestination", "MLFlowLogger",
           "ProgressBarLogger", "RemoteUploaderDownloader", "TensorboardLogger", "WandBLogger"]
