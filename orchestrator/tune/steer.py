"""The constants that steer the tuner's loop and its confirmation, in one place. They are not
user knobs (tune.* holds those); each says what it steers."""

MAX_DUPLICATES = 20  # re-proposed configs in a row before the study calls the space covered (study.Tuner._trials)
MAX_REJECTED = 10  # sampler configs in a row the job model may keep from a launch; the next one tests the model
CONFIRM_ROUNDS = 2  # interleaved re-measurements of each candidate before the pick (tune.confirm_top)
CONFIRM_LONGER = 2.0  # the confirmation runs' windows and minimum measured time, relative to a trial's (same cap)
CONFIRM_MAX_ROUNDS = 4  # more rounds, of the candidates still within the noise of the leader (rules.open_contest) only
WAIT_FOR_TRIALS_S = 1.0  # how often a tuner about to confirm looks whether the other tuners' trials ended
